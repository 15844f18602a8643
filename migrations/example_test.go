package migrations_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/migrations"
)

func ExampleAll() {
	all, err := migrations.All()
	if err != nil {
		panic(err)
	}
	for _, m := range all {
		fmt.Printf("%03d_%s\n", m.Version, m.Name)
	}
	// Output:
	// 001_outbox
	// 002_consumer
	// 003_held_events
}

// Applying the schema from a service's start-up code, before producers or
// consumers start. (Not run here: it needs a database.)
func ExampleUp() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/test")
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool, migrations.Config{Schema: "eventline", Shards: 8}); err != nil {
		panic(err)
	}
}
