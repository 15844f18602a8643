package store_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/migrations"
)

// Recording an event in the handler's transaction: the second delivery of
// the same event is recognised as a duplicate.
func ExampleStore_RecordProcessed() {
	ctx := context.Background()
	pool, schema := exampleDB(ctx)
	defer dropSchema(ctx, pool, schema)
	st, err := store.New(schema)
	if err != nil {
		panic(err)
	}
	e := eventline.Event{ID: "evt-1", Type: "order.paid", AggregateType: "order", AggregateID: "o-1", AggregateVersion: 2}
	for delivery := 1; delivery <= 2; delivery++ {
		tx, err := pool.Begin(ctx)
		if err != nil {
			panic(err)
		}
		fresh, err := st.RecordProcessed(ctx, tx, "billing", e, dedup.OutcomeApplied)
		if err != nil {
			panic(err)
		}
		if fresh {
			// ... the handler's writes go through tx here ...
			fmt.Printf("delivery %d: applied\n", delivery)
		} else {
			fmt.Printf("delivery %d: duplicate, skipped\n", delivery)
		}
		if err := tx.Commit(ctx); err != nil {
			panic(err)
		}
	}
	// Output:
	// delivery 1: applied
	// delivery 2: duplicate, skipped
}

// A retention run: at most BatchSize rows per statement, a pause between
// statements.
func ExampleStore_CleanupProcessed() {
	ctx := context.Background()
	pool, schema := exampleDB(ctx)
	defer dropSchema(ctx, pool, schema)
	st, _ := store.New(schema)
	_, _ = pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(schema, "processed_events")+` (consumer_group, event_id, outcome, processed_at)
		SELECT 'billing', 'e' || i, 'applied', now() - interval '30 days' FROM generate_series(1, 2500) i`)

	res, err := st.CleanupProcessed(ctx, pool, store.CleanupConfig{
		Group:     "billing",
		Retention: 14 * 24 * time.Hour, // longer than the topic's retention
		BatchSize: 1000,
		Pause:     10 * time.Millisecond,
	})
	if err != nil {
		panic(err)
	}
	fmt.Println("deleted", res.Deleted, "in", res.Batches, "batches")
	// Output:
	// deleted 2500 in 3 batches
}

func exampleDB(ctx context.Context) (*pgxpool.Pool, string) {
	pool, err := pgxpool.New(ctx, pgtest.URL())
	if err != nil {
		panic(err)
	}
	schema := "example_dedup_" + fmt.Sprint(time.Now().UnixNano())
	if err := migrations.Up(ctx, pool, migrations.Config{Schema: schema, Shards: 1}); err != nil {
		panic(err)
	}
	return pool, schema
}

func dropSchema(ctx context.Context, pool *pgxpool.Pool, schema string) {
	_, _ = pool.Exec(ctx, `DROP SCHEMA `+sqlident.Quote(schema)+` CASCADE`)
	pool.Close()
}
