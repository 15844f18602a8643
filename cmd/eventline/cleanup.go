package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/producer"
)

// defaultCleanupPause is the CLI's wait between delete batches, for both
// tables.
const defaultCleanupPause = 100 * time.Millisecond

// errDryRun rolls back a dry run's transaction.
var errDryRun = errors.New("dry run")

// cleanupReport is the outcome of `eventline cleanup`; nil parts were not run.
type cleanupReport struct {
	DryRun bool           `json:"dry_run"`
	Outbox *outboxCleanup `json:"outbox,omitempty"`
	Dedup  *dedupCleanup  `json:"dedup,omitempty"`
}

type outboxCleanup struct {
	RetentionSeconds float64       `json:"retention_seconds"`
	Deleted          int64         `json:"deleted"`
	PerShard         map[int]int64 `json:"per_shard"`
}

type dedupCleanup struct {
	Group            string    `json:"group,omitempty"`
	RetentionSeconds float64   `json:"retention_seconds"`
	Cutoff           time.Time `json:"cutoff"`
	Deleted          int64     `json:"deleted"`
	Batches          int       `json:"batches"`
}

const cleanupHelp = `
Applies retention to the two tables that grow forever:

  outbox  deletes rows written more than -retention ago that every consumer
          of their shard (the relays) has acknowledged; unrelayed rows stay.
          Relays already do this every -cleanup-interval for their shards.
  dedup   deletes processed_events rows older than -dedup-retention (of one
          -group, or all); rows of parked events stay. Keep it longer than
          Kafka can redeliver (topic retention plus relay retries and replays).

Deletes run in batches of -batch rows, each its own short transaction, with
-pause between them. -dry-run runs the same deletes in a transaction it rolls
back, and reports what would be deleted (it locks those rows meanwhile).

Outbox created_at is in the producers' session time zone: run cleanup with the
same TimeZone (a timezone=... parameter in -database-url).`

func runCleanup(ctx context.Context, inv *invocation) error {
	fs := inv.fs
	only := fs.String("only", "", "clean only `TABLE`: outbox or dedup (default both)")
	retention := fs.Duration("retention", producer.DefaultRetentionWindow, "keep outbox rows this long after they were written")
	dedupRetention := fs.Duration("dedup-retention", dedup.DefaultRetention, fmt.Sprintf("keep dedup records this long after they were processed (at least %s)", dedup.MinRetention))
	group := fs.String("group", "", "clean dedup records of this consumer group only (default all groups)")
	batch := fs.Int("batch", producer.DefaultCleanupBatchSize, "most rows one delete statement removes")
	pause := fs.Duration("pause", defaultCleanupPause, "wait between two batches")
	dryRun := fs.Bool("dry-run", false, "report what would be deleted and delete nothing")
	inv.jsonFlag("print JSON instead of text")
	if _, err := inv.parse(); err != nil {
		return err
	}
	doOutbox, doDedup := *only == "" || *only == "outbox", *only == "" || *only == "dedup"
	switch {
	case !doOutbox && !doDedup:
		return usageErrorf("-only %q: want outbox or dedup (or leave it out for both)", *only)
	case *retention <= 0:
		return usageErrorf("-retention must be positive, got %s", *retention)
	case *dedupRetention < dedup.MinRetention:
		return usageErrorf("-dedup-retention must be at least %s (it must outlast Kafka's redelivery horizon), got %s", dedup.MinRetention, *dedupRetention)
	case *batch < 1:
		return usageErrorf("-batch must be at least 1, got %d", *batch)
	case *pause < 0:
		return usageErrorf("-pause must not be negative, got %s", *pause)
	case *group != "" && !doDedup:
		return usageErrorf("-group applies to dedup records; it cannot be combined with -only outbox")
	}
	g := inv.globals
	pool, err := inv.pool(ctx)
	if err != nil {
		return err
	}

	if *dryRun {
		*pause = 0 // nothing is deleted: no need to spare the database
	}
	rep := cleanupReport{DryRun: *dryRun}
	if doOutbox {
		cfg := admin.CleanupConfig{Schema: g.schema, Retention: *retention, BatchSize: *batch, Pause: *pause}
		err := maybeDry(ctx, pool, *dryRun, func(db admin.DBTX) error {
			res, err := admin.Cleanup(ctx, db, cfg)
			rep.Outbox = &outboxCleanup{RetentionSeconds: retention.Seconds(), Deleted: res.Deleted, PerShard: res.PerShard}
			return err
		})
		if err != nil {
			return fmt.Errorf("outbox cleanup: %w", err)
		}
	}
	if doDedup {
		st, err := store.New(g.schema)
		if err != nil {
			return err
		}
		// dedup's Pause 0 means its default; the smallest wait stands for none.
		cfg := store.CleanupConfig{Group: *group, Retention: *dedupRetention, BatchSize: *batch, Pause: max(*pause, time.Nanosecond)}
		err = maybeDry(ctx, pool, *dryRun, func(db admin.DBTX) error {
			res, err := st.CleanupProcessed(ctx, db, cfg)
			rep.Dedup = &dedupCleanup{Group: *group, RetentionSeconds: dedupRetention.Seconds(), Cutoff: res.Cutoff.UTC(), Deleted: res.Deleted, Batches: res.Batches}
			return err
		})
		if err != nil {
			return fmt.Errorf("dedup cleanup: %w", err)
		}
	}
	return inv.output(rep, func(w io.Writer) error { printCleanup(w, rep); return nil })
}

// maybeDry runs fn on the pool, or, for a dry run, in a transaction it
// rolls back.
func maybeDry(ctx context.Context, pool *pgxpool.Pool, dry bool, fn func(admin.DBTX) error) error {
	if !dry {
		return fn(pool)
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := fn(tx); err != nil {
			return err
		}
		return errDryRun
	})
	if errors.Is(err, errDryRun) {
		return nil
	}
	return err
}

func printCleanup(w io.Writer, rep cleanupReport) {
	verb := "deleted"
	if rep.DryRun {
		verb = "would delete"
	}
	if o := rep.Outbox; o != nil {
		fmt.Fprintf(w, "outbox: %s %s written more than %s ago and already relayed", verb, plural(o.Deleted, "row"), shortDuration(seconds(o.RetentionSeconds)))
		var shards []int
		for s, n := range o.PerShard {
			if n > 0 {
				shards = append(shards, s)
			}
		}
		slices.Sort(shards)
		var parts []string
		for _, s := range shards {
			parts = append(parts, fmt.Sprintf("shard %d: %d", s, o.PerShard[s]))
		}
		if len(parts) > 0 {
			fmt.Fprintf(w, " (%s)", strings.Join(parts, ", "))
		}
		fmt.Fprintln(w)
	}
	if d := rep.Dedup; d != nil {
		scope := "all groups"
		if d.Group != "" {
			scope = "group " + d.Group
		}
		fmt.Fprintf(w, "dedup: %s %s processed before %s (%s, %s)\n", verb, plural(d.Deleted, "record"), timestamp(d.Cutoff), scope, plural(int64(d.Batches), "batch"))
	}
}
