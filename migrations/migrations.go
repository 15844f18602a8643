package migrations

import (
	"cmp"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/nilcheck"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
)

// FS holds the numbered migrations as NNN_name.up.sql / NNN_name.down.sql
// under sql/. They are written without a schema prefix: run them with
// search_path set to the eventline schema. The outbox shard tables are not in
// FS; they come from watermill-sql's schema adapter (see [ShardTableSQL]).
//
//go:embed sql/*.sql
var FS embed.FS

// Defaults for [Config].
const (
	DefaultSchema = "eventline"
	DefaultShards = 8
)

// ErrShardCountMismatch is returned when Config.Shards asks for a different
// shard count than the outbox was created with.
var ErrShardCountMismatch = errors.New("eventline: outbox shard count mismatch")

// Config says where eventline's tables live.
type Config struct {
	// Schema is the PostgreSQL schema holding every eventline table. It is
	// created if missing. Defaults to "eventline".
	Schema string
	// Shards is the number of outbox shards created on the first Up.
	// Afterwards it must be 0 (keep) or equal to the stored count: changing
	// it would move aggregates between shards while events are in flight.
	// Defaults to 8.
	Shards int
}

// checked returns c with its defaults, or an error naming the argument of
// fn that is wrong.
func (c Config) checked(fn string, db Beginner) (Config, error) {
	c.Schema = cmp.Or(c.Schema, DefaultSchema)
	if nilcheck.IsNil(db) {
		return c, fmt.Errorf("%s: db is nil: pass a *pgxpool.Pool or *pgx.Conn", fn)
	}
	if err := sqlident.Validate("migrations.Config.Schema", c.Schema); err != nil {
		return c, err
	}
	if c.Shards < 0 || c.Shards > outbox.MaxShards {
		return c, fmt.Errorf("migrations.Config.Shards must be between 1 and %d (0 means the default, %d), got %d", outbox.MaxShards, DefaultShards, c.Shards)
	}
	return c, nil
}

// Beginner is the smallest database handle migrations need; *pgxpool.Pool
// and *pgx.Conn satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// Migration is one numbered schema change.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
}

// MigrationStatus reports whether a migration is applied.
type MigrationStatus struct {
	Version   int
	Name      string
	AppliedAt time.Time // zero when not applied
}

// Applied reports whether the migration has been applied.
func (s MigrationStatus) Applied() bool { return !s.AppliedAt.IsZero() }

// All returns the embedded migrations in version order.
func All() ([]Migration, error) {
	entries, err := fs.ReadDir(FS, "sql")
	if err != nil {
		return nil, err
	}
	byVersion := map[int]*Migration{}
	for _, e := range entries {
		name := e.Name()
		var dir string
		switch {
		case strings.HasSuffix(name, ".up.sql"):
			dir = "up"
		case strings.HasSuffix(name, ".down.sql"):
			dir = "down"
		default:
			continue
		}
		base := strings.TrimSuffix(strings.TrimSuffix(name, ".sql"), "."+dir)
		num, label, ok := strings.Cut(base, "_")
		version, err := strconv.Atoi(num)
		if !ok || err != nil {
			return nil, fmt.Errorf("migration file %q: want NNN_name.%s.sql", name, dir)
		}
		body, err := fs.ReadFile(FS, path.Join("sql", name))
		if err != nil {
			return nil, err
		}
		m := byVersion[version]
		if m == nil {
			m = &Migration{Version: version, Name: label}
			byVersion[version] = m
		}
		if dir == "up" {
			m.Up = string(body)
		} else {
			m.Down = string(body)
		}
	}
	out := make([]Migration, 0, len(byVersion))
	for _, m := range byVersion {
		if m.Up == "" || m.Down == "" {
			return nil, fmt.Errorf("migration %03d_%s needs both an up and a down file", m.Version, m.Name)
		}
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Up applies every pending migration and makes sure the outbox shard tables
// exist, all in one transaction under an advisory lock, so concurrent callers
// are safe and a failure leaves nothing half-applied. It never runs inside a
// caller's business transaction.
func Up(ctx context.Context, db Beginner, cfg Config) error {
	cfg, err := cfg.checked("migrations.Up", db)
	if err != nil {
		return err
	}
	all, err := All()
	if err != nil {
		return err
	}
	return inMigrationTx(ctx, db, cfg.Schema, all, func(tx pgx.Tx, applied map[int]time.Time) error {
		for _, m := range all {
			if _, ok := applied[m.Version]; ok {
				continue
			}
			if _, err := tx.Exec(ctx, m.Up); err != nil {
				return fmt.Errorf("migration %03d_%s up: %w", m.Version, m.Name, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO schema_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
				return fmt.Errorf("record migration %03d: %w", m.Version, err)
			}
		}
		return ensureShards(ctx, tx, cfg)
	})
}

// Down rolls back the newest steps applied migrations (all of them when steps
// is 0). Rolling back the first migration also drops the outbox shard
// tables, and every event still in them. A negative steps is an error, not
// "all": a sign slip must not drop the outbox.
func Down(ctx context.Context, db Beginner, cfg Config, steps int) error {
	cfg, err := cfg.checked("migrations.Down", db)
	if err != nil {
		return err
	}
	if steps < 0 {
		return fmt.Errorf("migrations.Down: steps is %d; give how many migrations to roll back, or 0 for all of them", steps)
	}
	all, err := All()
	if err != nil {
		return err
	}
	return inMigrationTx(ctx, db, cfg.Schema, all, func(tx pgx.Tx, applied map[int]time.Time) error {
		done := 0
		for i := len(all) - 1; i >= 0 && (steps == 0 || done < steps); i-- {
			m := all[i]
			if _, ok := applied[m.Version]; !ok {
				continue
			}
			if m.Version == all[0].Version {
				if err := dropShards(ctx, tx, cfg.Schema); err != nil {
					return err
				}
			}
			if _, err := tx.Exec(ctx, m.Down); err != nil {
				return fmt.Errorf("migration %03d_%s down: %w", m.Version, m.Name, err)
			}
			if _, err := tx.Exec(ctx, `DELETE FROM schema_migrations WHERE version = $1`, m.Version); err != nil {
				return err
			}
			done++
		}
		return nil
	})
}

// Status lists every embedded migration and when it was applied. It only
// reads: a schema that does not exist yet reports every migration pending.
func Status(ctx context.Context, db Beginner, cfg Config) ([]MigrationStatus, error) {
	cfg, err := cfg.checked("migrations.Status", db)
	if err != nil {
		return nil, err
	}
	all, err := All()
	if err != nil {
		return nil, err
	}
	applied := map[int]time.Time{}
	err = pgx.BeginTxFunc(ctx, db, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		var exists bool
		table := sqlident.Qualify(cfg.Schema, "schema_migrations")
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil {
			return err
		}
		if !exists {
			return nil
		}
		rows, err := tx.Query(ctx, `SELECT version, applied_at FROM `+table)
		if err != nil {
			return err
		}
		var v int
		var at time.Time
		_, err = pgx.ForEachRow(rows, []any{&v, &at}, func() error { applied[v] = at; return nil })
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("read migration status: %w", err)
	}
	out := make([]MigrationStatus, 0, len(all))
	for _, m := range all {
		out = append(out, MigrationStatus{Version: m.Version, Name: m.Name, AppliedAt: applied[m.Version]})
	}
	return out, nil
}

// inMigrationTx runs fn in a transaction holding the schema's migration lock,
// with search_path set to the schema and the tracking table in place. It
// refuses a schema that records a migration all does not have (a
// pre-release eventline's, see preReleaseError).
func inMigrationTx(ctx context.Context, db Beginner, schema string, all []Migration, fn func(pgx.Tx, map[int]time.Time) error) error {
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('eventline.migrate.' || $1::text))`, schema); err != nil {
			return fmt.Errorf("take migration lock: %w", err)
		}
		q := sqlident.Quote(schema)
		if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+q); err != nil {
			return fmt.Errorf("create schema %s: %w", q, err)
		}
		if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+q); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
			version    integer PRIMARY KEY,
			name       text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now()
		)`); err != nil {
			return fmt.Errorf("create schema_migrations: %w", err)
		}
		rows, err := tx.Query(ctx, `SELECT version, name, applied_at FROM schema_migrations ORDER BY version`)
		if err != nil {
			return err
		}
		known := map[int]string{}
		for _, m := range all {
			known[m.Version] = m.Name
		}
		applied := map[int]time.Time{}
		var foreign []string
		var v int
		var name string
		var at time.Time
		_, err = pgx.ForEachRow(rows, []any{&v, &name, &at}, func() error {
			if known[v] != name {
				foreign = append(foreign, fmt.Sprintf("%03d_%s", v, name))
			}
			applied[v] = at
			return nil
		})
		if err != nil {
			return err
		}
		if len(foreign) > 0 {
			return preReleaseError(schema, foreign)
		}
		return fn(tx, applied)
	})
}

// ensureShards records the shard count on first install, checks it later,
// and creates any missing shard tables.
func ensureShards(ctx context.Context, tx pgx.Tx, cfg Config) error {
	var stored int
	err := tx.QueryRow(ctx, `SELECT shards FROM outbox_config`).Scan(&stored)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		stored = cmp.Or(cfg.Shards, DefaultShards)
		if _, err := tx.Exec(ctx, `INSERT INTO outbox_config (shards) VALUES ($1)`, stored); err != nil {
			return err
		}
	case err != nil:
		return fmt.Errorf("read outbox_config: %w", err)
	case cfg.Shards != 0 && cfg.Shards != stored:
		return fmt.Errorf("%w: schema %q has %d shards, config asks for %d; changing the count would move aggregates between shards with events in flight, so set Shards to 0 or %d",
			ErrShardCountMismatch, cfg.Schema, stored, cfg.Shards, stored)
	}
	for shard := 0; shard < stored; shard++ {
		for _, q := range ShardTableSQL(cfg.Schema, shard) {
			if _, err := tx.Exec(ctx, q); err != nil {
				return fmt.Errorf("create outbox shard %d: %w", shard, err)
			}
		}
	}
	return nil
}

// ShardTableSQL returns the statements that create one outbox shard: the
// messages and offsets tables from watermill-sql's own PostgreSQL adapters,
// and the trigger that wakes relays on insert. They are idempotent.
func ShardTableSQL(schema string, shard int) []string {
	topic := outbox.Topic(shard)
	var out []string
	sq, _ := outbox.SchemaAdapter(schema, 0).SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams{Topic: topic})
	oq, _ := outbox.OffsetsAdapter(schema).SchemaInitializingQueries(wsql.OffsetsSchemaInitializingQueriesParams{Topic: topic})
	for _, q := range append(sq, oq...) {
		out = append(out, q.Query)
	}
	out = append(out, fmt.Sprintf(`CREATE OR REPLACE TRIGGER %s AFTER INSERT ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s(%s)`,
		sqlident.Quote(topic+"_notify"), sqlident.Qualify(schema, outbox.Table(shard)),
		sqlident.Qualify(schema, "notify_outbox"), quoteLiteral(fmt.Sprintf("%s.%d", schema, shard))+", "+quoteLiteral(fmt.Sprint(shard))))
	return out
}

func dropShards(ctx context.Context, tx pgx.Tx, schema string) error {
	var shards int
	err := tx.QueryRow(ctx, `SELECT shards FROM outbox_config`).Scan(&shards)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return err
	}
	for shard := 0; shard < shards; shard++ {
		if _, err := tx.Exec(ctx, `DROP TABLE IF EXISTS `+sqlident.Qualify(schema, outbox.Table(shard))+`, `+sqlident.Qualify(schema, outbox.OffsetsTable(shard))); err != nil {
			return fmt.Errorf("drop outbox shard %d: %w", shard, err)
		}
	}
	return nil
}

// preReleaseError refuses a schema migrated by a build whose migrations
// this one does not have: a pre-release eventline's 003_consumer_gate to
// 007_dedup_scope, squashed into 001-003 for the first release, whose
// tables (dead_letters, consumer_dead_letters, late_events) became
// held_events. Running this build's files over it would leave the old
// shape behind.
func preReleaseError(schema string, foreign []string) error {
	return fmt.Errorf("schema %q records migrations this build does not have (%s): it was migrated by a pre-release eventline, whose migrations the first release squashed; "+
		"resolve what it holds, roll it back with that build (`eventline migrate down -all`), then run `eventline migrate up` with this one (docs/OPERATIONS.md, \"Moving a pre-release schema\")",
		schema, strings.Join(foreign, ", "))
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
