package middleware_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// exampleDatabase opens the test database and migrates a fresh schema for
// an example; cleanup drops it.
func exampleDatabase() (pool *pgxpool.Pool, schema string, cleanup func()) {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		panic(err)
	}
	cfg.MaxConns = 4
	pool, err = pgxpool.NewWithConfig(ctx, cfg)
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

// exampleKafka starts an in-process Kafka (kfake, reached over TCP) with
// the given topics (2 partitions each). In-process even in real-broker
// mode: the examples' topic names are fixed, as in a user's code.
func exampleKafka(topics ...string) (brokers []string, stop func()) {
	c, err := kafkatest.New(context.Background(), kafkatest.Config{InProcess: true, Partitions: 2, Topics: topics})
	if err != nil {
		panic(err)
	}
	return c.Brokers, c.Close
}
