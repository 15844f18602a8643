package middleware_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/internal/devkafka"
	"github.com/eventline/eventline/internal/kafkaconf"
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
// the given topics.
func exampleKafka(topics ...string) (brokers []string, stop func()) {
	cluster, err := devkafka.Start(0)
	if err != nil {
		panic(err)
	}
	brokers = cluster.ListenAddrs()
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	admin, err := sarama.NewClusterAdmin(brokers, cfg)
	if err != nil {
		panic(err)
	}
	defer admin.Close()
	for _, t := range topics {
		if err := admin.CreateTopic(t, &sarama.TopicDetail{NumPartitions: 2, ReplicationFactor: 1}, false); err != nil {
			panic(err)
		}
	}
	// Wait until the cluster lists every topic.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		listed, err := admin.ListTopics()
		missing := err != nil
		for _, t := range topics {
			if _, ok := listed[t]; !ok {
				missing = true
			}
		}
		if !missing {
			break
		}
		if time.Now().After(deadline) {
			panic(fmt.Sprintf("topics %v not listed after 10s: %v", topics, err))
		}
	}
	return brokers, cluster.Close
}
