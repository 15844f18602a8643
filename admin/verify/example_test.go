package verify_test

import (
	"context"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/admin/verify"
)

// A canary of your own: check the last hour's events against every
// consumer group's records, and alert on what is broken. This is what
// `eventline verify -since 1h -brokers …` runs.
func ExampleRun() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	rep, err := verify.Run(ctx, pool, nil, verify.Config{
		Since:   time.Now().Add(-time.Hour),
		Brokers: []string{"localhost:9092"},
	})
	if err != nil {
		log.Fatal(err) // the check could not run: a database or Kafka unreachable
	}
	for _, f := range rep.Findings {
		if f.Severity == verify.Problem {
			log.Printf("%s %s: event %s of %s/%s (group %q)", f.Severity, f.Kind, f.EventID, f.AggregateType, f.AggregateID, f.Group)
		}
	}
	if !rep.OK {
		os.Exit(3)
	}
}
