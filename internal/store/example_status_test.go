package store_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/versioning"
)

// A consumer group's gaps and stalls, as `eventline status` shows them and
// Store.NewStatusCollector exposes them to Prometheus (`eventline relay`
// registers it next to its own metrics).
func ExampleStore_ReadGroupStatus() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, pgtest.URL())
	defer pool.Close()
	schema := fmt.Sprintf("example_group_status_%d", time.Now().UnixNano())
	if err := migrations.Up(ctx, pool, migrations.Config{Schema: schema, Shards: 1}); err != nil {
		panic(err)
	}
	defer func() { _, _ = pool.Exec(ctx, `DROP SCHEMA `+sqlident.Quote(schema)+` CASCADE`) }()
	s, _ := store.New(schema)
	// Version 1 of order 42 was applied; version 3 arrived and parked.
	for _, v := range []int64{1, 3} {
		e := consumertest.Event("42", v)
		_ = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			a, err := s.Admit(ctx, tx, "billing", e, false)
			if err != nil || a.Verdict != store.Gap {
				return err
			}
			_, err = s.Park(ctx, tx, store.ParkRequest{Group: "billing", Event: e, Current: a.Previous, MaxGap: versioning.DefaultMaxGap})
			return err
		})
	}
	st, err := s.ReadGroupStatus(ctx, pool, "billing", store.ReadGroupStatusOptions{})
	if err != nil {
		panic(err)
	}
	fmt.Printf("%s: %d parked, %d open gap\n", st.Group, st.Parked, st.OpenGapCount)
	for _, g := range st.OpenGaps {
		fmt.Printf("%s/%s at v%d waits for v%d..v%d\n", g.AggregateType, g.AggregateID, g.Current, g.Current+1, g.Follows)
	}
	_ = s.NewStatusCollector(pool) // register it with a prometheus.Registerer
	// Output:
	// billing: 1 parked, 1 open gap
	// thing/42 at v1 waits for v2..v2
}
