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
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/producer"
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
