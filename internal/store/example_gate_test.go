package store_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/versioning"
)

// An operator gives up on versions that will never arrive
// (`eventline parked release`); the running consumer's sweeper then applies
// the parked events.
func ExampleStore_ReleaseGap() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, pgtest.URL())
	defer pool.Close()
	schema := fmt.Sprintf("example_versioning_%d", time.Now().UnixNano())
	if err := migrations.Up(ctx, pool, migrations.Config{Schema: schema, Shards: 1}); err != nil {
		panic(err)
	}
	defer func() { _, _ = pool.Exec(ctx, `DROP SCHEMA `+sqlident.Quote(schema)+` CASCADE`) }()
	st, _ := store.New(schema)

	// Version 1 applied, version 4 arrived early and was parked.
	_ = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		v1 := eventline.Event{ID: "e1", Type: "stock.moved", AggregateType: "sku", AggregateID: "A-1", AggregateVersion: 1, Payload: []byte(`{}`)}
		v4 := v1
		v4.ID, v4.AggregateVersion = "e4", 4
		_, _ = st.Admit(ctx, tx, "warehouse", v1, false)
		_, _ = st.Admit(ctx, tx, "warehouse", v4, false)
		_, err := st.Park(ctx, tx, store.ParkRequest{Group: "warehouse", Event: v4, MaxGap: versioning.DefaultMaxGap})
		return err
	})

	parked, _ := st.ListParked(ctx, pool, store.ParkedFilter{Group: "warehouse"})
	fmt.Println("parked:", parked[0].AggregateID, "v", parked[0].Version)

	rel, err := st.ReleaseGap(ctx, pool, "warehouse", "sku", "A-1", "v2-v3 lost in the 2026-11 outage")
	if err != nil {
		panic(err)
	}
	fmt.Printf("skipped v%d..v%d, %d ready\n", rel.From, rel.To, rel.Ready)
	// Output:
	// parked: A-1 v 4
	// skipped v2..v3, 1 ready
}
