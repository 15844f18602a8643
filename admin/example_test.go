package admin_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// What an operator looks at first: the backlog and who relays it, each
// consumer group's state, the events held for the operator, and whether the outbox was
// moved from another cluster. Here one event waits for a relay.
func Example() {
	ctx := context.Background()
	pool, schema, drop := exampleDatabase()
	defer drop()
	prod, err := producer.New(ctx, pool, producer.Config{Schema: schema, DefaultTopic: "orders"})
	if err != nil {
		panic(err)
	}
	created, _ := eventline.NewJSONEvent("order.created", "order", "o-1", map[string]int{"total": 30})
	if err := prod.Publish(ctx, pool, created); err != nil {
		panic(err)
	}

	var st admin.Status
	err = pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		st, err = admin.ReadStatus(ctx, tx, schema, 0) // one snapshot
		return err
	})
	if err != nil {
		panic(err)
	}
	fmt.Println("backlog:", st.Outbox.Backlog(), "shards owned:", len(st.Owners), "consumer groups:", len(st.Groups))
	held, err := admin.ListHeld(ctx, pool, schema, admin.HeldFilter{})
	if err != nil {
		panic(err)
	}
	fmt.Println("held events:", len(held))
	checks, err := admin.CheckPositions(ctx, pool, schema)
	if err != nil {
		panic(err)
	}
	fmt.Println("shard 0 needs RebasePositions:", checks[0].Ahead())
	// Output:
	// backlog: 1 shards owned: 0 consumer groups: 0
	// held events: 0
	// shard 0 needs RebasePositions: false
}

// exampleDatabase migrates a schema of its own in the test database.
func exampleDatabase() (pool *pgxpool.Pool, schema string, drop func()) {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.URL())
	if err != nil {
		panic(err)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	schema = "example_" + hex.EncodeToString(b[:])
	if err := migrations.Up(ctx, pool, migrations.Config{Schema: schema, Shards: 1}); err != nil {
		panic(err)
	}
	return pool, schema, func() {
		_, _ = pool.Exec(ctx, `DROP SCHEMA `+sqlident.Quote(schema)+` CASCADE`)
		pool.Close()
	}
}

// A consumer group's gaps and stalls, as `eventline status` shows them and
// NewStatusCollector exposes them to Prometheus (`eventline relay`
// registers it next to its own metrics).
func ExampleReadStatus_groups() {
	ctx := context.Background()
	pool, schema, drop := exampleDatabase()
	defer drop()
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
	st, err := admin.ReadStatus(ctx, pool, schema, 0)
	if err != nil {
		panic(err)
	}
	for _, g := range st.Groups {
		fmt.Printf("%s: %d parked, %d open gap\n", g.Group, g.Parked, g.OpenGapCount)
		for _, o := range g.OpenGaps {
			fmt.Printf("%s/%s at v%d waits for v%d..v%d\n", o.AggregateType, o.AggregateID, o.Current, o.Current+1, o.Follows)
		}
	}
	_, _ = admin.NewStatusCollector(pool, schema) // register it with a prometheus.Registerer
	// Output:
	// billing: 1 parked, 1 open gap
	// thing/42 at v1 waits for v2..v2
}
