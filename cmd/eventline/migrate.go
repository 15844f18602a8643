package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/migrations"
)

const migrateUpHelp = `
Applies every pending migration in one transaction under an advisory lock
(safe to run from several processes at once) and creates the outbox shard
tables. Run it before starting producers, relays or consumers.`

func migrateUp(ctx context.Context, inv *invocation) error {
	shards := inv.fs.Int("shards", 0, fmt.Sprintf("number of outbox shards, fixed on the first run (0 means %d on the first run\nand the existing count afterwards; another value must equal the existing count)", migrations.DefaultShards))
	if _, err := inv.parse(); err != nil {
		return err
	}
	if *shards < 0 || *shards > outbox.MaxShards {
		return usageErrorf("-shards must be between 1 and %d (or 0 for the default), got %d", outbox.MaxShards, *shards)
	}
	pool, cfg, before, err := inv.migrationStatus(ctx)
	if err != nil {
		return err
	}
	cfg.Shards = *shards
	if err := migrations.Up(ctx, pool, cfg); err != nil {
		if errors.Is(err, migrations.ErrShardCountMismatch) {
			return fmt.Errorf("%w (omit -shards to keep the existing count)", err)
		}
		return err
	}
	state := "was already"
	for _, m := range before {
		if !m.Applied() {
			fmt.Fprintf(inv.stdout, "applied %03d_%s\n", m.Version, m.Name)
			state = "is"
		}
	}
	n, err := admin.ReadShardCount(ctx, pool, cfg.Schema)
	if err != nil {
		return err
	}
	fmt.Fprintf(inv.stdout, "schema %s %s up to date (%s, %s)\n", cfg.Schema, state, plural(int64(len(before)), "migration"), plural(int64(n), "outbox shard"))
	return nil
}

// migrationStatus connects and reads the status of every migration in
// -schema.
func (inv *invocation) migrationStatus(ctx context.Context) (*pgxpool.Pool, migrations.Config, []migrations.MigrationStatus, error) {
	cfg := migrations.Config{Schema: inv.globals.schema}
	pool, err := inv.pool(ctx)
	if err != nil {
		return nil, cfg, nil, err
	}
	st, err := migrations.Status(ctx, pool, cfg)
	if err != nil {
		return nil, cfg, nil, fmt.Errorf("read migration status: %w", err)
	}
	return pool, cfg, st, nil
}

const migrateDownHelp = `
Rolls back the newest applied migrations, one transaction for all of them.

Rolling back 003_held_events drops the events held for the operator (dead
letters, late events); 002_consumer the consumer tables (dedup records,
aggregate versions, parked events, the skipped-gap audit); 001_outbox the outbox
shard tables with every event in them. Unless -force is given, it refuses while
held events are neither replayed nor discarded, while parked events wait, or
while the outbox holds events not yet relayed.`

func migrateDown(ctx context.Context, inv *invocation) error {
	fs := inv.fs
	steps := fs.Int("steps", 1, "number of migrations to roll back, newest first (at least 1)")
	all := fs.Bool("all", false, "roll back every migration (drops all of eventline's tables)")
	force := fs.Bool("force", false, "roll back even if it drops events that were never relayed or applied")
	if _, err := inv.parse(); err != nil {
		return err
	}
	switch {
	case *all && fs.isSet("steps"):
		return usageErrorf("give -steps or -all, not both")
	case *steps < 1:
		return usageErrorf("-steps must be at least 1, got %d (use -all to roll back everything)", *steps)
	}
	pool, cfg, st, err := inv.migrationStatus(ctx)
	if err != nil {
		return err
	}
	var targets []migrations.MigrationStatus
	for i := len(st) - 1; i >= 0 && (*all || len(targets) < *steps); i-- {
		if st[i].Applied() {
			targets = append(targets, st[i])
		}
	}
	if len(targets) == 0 {
		fmt.Fprintf(inv.stdout, "schema %s has no applied migrations; nothing to roll back\n", cfg.Schema)
		return nil
	}
	if !*force {
		if err := checkSafeToDrop(ctx, pool, cfg.Schema, targets); err != nil {
			return err
		}
	}
	n := len(targets)
	if *all {
		n = 0
	}
	if err := migrations.Down(ctx, pool, cfg, n); err != nil {
		return err
	}
	for _, m := range targets {
		fmt.Fprintf(inv.stdout, "rolled back %03d_%s\n", m.Version, m.Name)
	}
	return nil
}

// checkSafeToDrop refuses a rollback that would drop events still on their
// way: parked or late events, unrelayed outbox rows, dead letters (the
// relay's and consumers') not replayed.
func checkSafeToDrop(ctx context.Context, pool *pgxpool.Pool, schema string, targets []migrations.MigrationStatus) error {
	for _, m := range targets {
		if m.Name == "outbox" {
			st, err := admin.ReadOutboxStatus(ctx, pool, schema)
			if err != nil {
				return fmt.Errorf("read outbox status before rollback: %w", err)
			}
			if st.Backlog() > 0 || st.DeadLetters > 0 {
				return fmt.Errorf("refusing to roll back %03d_%s: the outbox holds %s not yet relayed and %s not yet replayed, which would be lost; run a relay until `eventline status` shows no backlog, or pass -force",
					m.Version, m.Name, plural(st.Backlog(), "event"), plural(st.DeadLetters, "dead letter"))
			}
			continue
		}
		n, err := migrations.Unresolved(ctx, pool, migrations.Config{Schema: schema}, m.Version)
		if err != nil {
			return fmt.Errorf("before rollback: %w", err)
		}
		if n == 0 {
			continue
		}
		switch m.Name {
		case "consumer":
			return fmt.Errorf("refusing to roll back %03d_%s: parked_events holds %s, which would be lost; release them (eventline parked list, parked release) or pass -force",
				m.Version, m.Name, plural(n, "event"))
		case "held_events":
			return fmt.Errorf("refusing to roll back %03d_%s: held_events holds %s not yet replayed or discarded (dead letters, late events), which would be lost; resolve them (eventline held list, replay, discard) or pass -force",
				m.Version, m.Name, plural(n, "event"))
		default:
			return fmt.Errorf("refusing to roll back %03d_%s: it holds %d rows not yet resolved, which would be lost; pass -force to drop them", m.Version, m.Name, n)
		}
	}
	return nil
}

// migrationJSON is one migration in `migrate status -json`.
type migrationJSON struct {
	Version   int        `json:"version"`
	Name      string     `json:"name"`
	Applied   bool       `json:"applied"`
	AppliedAt *time.Time `json:"applied_at"`
}

const migrateStatusHelp = `
Lists every migration this build knows and when it was applied. Reading the
status creates the schema and its schema_migrations table if they are missing.`

func migrateStatus(ctx context.Context, inv *invocation) error {
	inv.jsonFlag("print JSON instead of a table")
	check := inv.fs.Bool("check", false, "exit with status 1 when a migration is pending (for readiness checks)")
	if _, err := inv.parse(); err != nil {
		return err
	}
	_, cfg, st, err := inv.migrationStatus(ctx)
	if err != nil {
		return err
	}
	pending := int64(0)
	for _, m := range st {
		if !m.Applied() {
			pending++
		}
	}
	report := struct {
		Schema     string          `json:"schema"`
		Migrations []migrationJSON `json:"migrations"`
		Pending    int64           `json:"pending"`
	}{cfg.Schema, mapList(st, func(m migrations.MigrationStatus) migrationJSON {
		j := migrationJSON{Version: m.Version, Name: m.Name, Applied: m.Applied()}
		if m.Applied() {
			at := m.AppliedAt.UTC()
			j.AppliedAt = &at
		}
		return j
	}), pending}
	err = inv.output(report, func(w io.Writer) error {
		tw := newTable(w)
		row(tw, "VERSION", "NAME", "APPLIED AT")
		for _, m := range report.Migrations {
			at := "pending"
			if m.Applied {
				at = timestamp(*m.AppliedAt)
			}
			row(tw, fmt.Sprintf("%03d", m.Version), m.Name, at)
		}
		if err := tw.Flush(); err != nil || pending == 0 {
			return err
		}
		_, err := fmt.Fprintf(w, "%s pending in schema %s: run `eventline migrate up`\n", plural(pending, "migration"), cfg.Schema)
		return err
	})
	if err == nil && *check && pending > 0 {
		err = fmt.Errorf("%s pending in schema %s", plural(pending, "migration"), cfg.Schema)
	}
	return err
}
