package eventlinetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/migrations"
)

// DefaultDatabaseURL is the database a Case runs against when neither
// Case.DatabaseURL, TEST_DATABASE_URL nor DATABASE_URL says otherwise.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// schemaTimeout bounds creating, migrating, resetting or dropping the
// schema.
const schemaTimeout = time.Minute

// poolSize is the connections a run may use: deliveries on two consumer
// instances at once during a rebalance, a sweeper pass, State.
const poolSize = 6

// databaseURL returns the URL to run against.
func databaseURL(u string) string {
	if u != "" {
		return u
	}
	for _, k := range []string{"TEST_DATABASE_URL", "DATABASE_URL"} {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return DefaultDatabaseURL
}

// schemaEnv is the isolated schema of one Check: eventline's tables and
// the user's, reached through a pool whose connections have search_path
// set to it. Every run starts from the state right after Setup: reset
// deletes every row and puts back what Setup left (kept in a second
// schema), and sets sequences back, which is much cheaper than creating
// and migrating a schema per run.
type schemaEnv struct {
	name, seed string
	pool       *pgxpool.Pool
	url        string
	// resetSQL restores the state right after Setup.
	resetSQL string
}

// newSchema creates a schema with a random name, applies eventline's
// migrations and setup to it, records the resulting state, and returns a
// pool whose connections have search_path set to the schema.
func newSchema(ctx context.Context, url string, setup func(context.Context, pgx.Tx) error) (*schemaEnv, error) {
	var b [5]byte
	_, _ = rand.Read(b[:])
	name := "eventlinetest_" + hex.EncodeToString(b[:])
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("eventlinetest: parse the database URL: %w", err)
	}
	cfg.MaxConns = poolSize
	cfg.ConnConfig.RuntimeParams["search_path"] = name
	cfg.ConnConfig.RuntimeParams["application_name"] = "eventlinetest:" + name
	sctx, cancel := context.WithTimeout(ctx, schemaTimeout)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(sctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("eventlinetest: connect to PostgreSQL: %w", err)
	}
	if err := pool.Ping(sctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("eventlinetest: PostgreSQL does not answer at %s (set TEST_DATABASE_URL or Case.DatabaseURL): %w", redact(url), err)
	}
	env := &schemaEnv{name: name, seed: name + "_seed", pool: pool, url: url}
	if err := migrations.Up(sctx, pool, migrations.Config{Schema: name, Shards: 1}); err != nil {
		env.close(ctx)
		return nil, fmt.Errorf("eventlinetest: migrate schema %s: %w", name, err)
	}
	if setup != nil {
		if err := pgx.BeginFunc(sctx, pool, func(tx pgx.Tx) error { return setup(sctx, tx) }); err != nil {
			env.close(ctx)
			return nil, fmt.Errorf("eventlinetest: Case.Setup: %w", err)
		}
	}
	if err := env.snapshot(sctx); err != nil {
		env.close(ctx)
		return nil, fmt.Errorf("eventlinetest: record the state after Setup: %w", err)
	}
	return env, nil
}

// snapshot copies the rows of every non-empty table into the seed schema,
// reads the sequences, and builds resetSQL.
func (s *schemaEnv) snapshot(ctx context.Context) error {
	q := func(ident ...string) string { return pgx.Identifier(ident).Sanitize() }
	rows, err := s.pool.Query(ctx, `SELECT c.relname FROM pg_class c
		WHERE c.relnamespace = $1::regnamespace AND c.relkind IN ('r', 'p') AND NOT c.relispartition ORDER BY c.relname`, q(s.name))
	if err != nil {
		return err
	}
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	rows, err = s.pool.Query(ctx, `SELECT r.relname, f.relname FROM pg_constraint k
		JOIN pg_class r ON r.oid = k.conrelid JOIN pg_class f ON f.oid = k.confrelid
		WHERE k.contype = 'f' AND k.connamespace = $1::regnamespace AND r.oid <> f.oid`, q(s.name))
	if err != nil {
		return err
	}
	refs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ From, To string }])
	if err != nil {
		return err
	}
	order, ok := childrenFirst(tables, refs)

	var script []string
	if ok {
		for _, t := range order {
			script = append(script, "DELETE FROM "+q(s.name, t))
		}
	} else {
		// A cycle of foreign keys: TRUNCATE handles it in one statement.
		var all []string
		for _, t := range tables {
			all = append(all, q(s.name, t))
		}
		script = append(script, "TRUNCATE "+strings.Join(all, ", "))
	}
	seeded := false
	for _, t := range slices.Backward(order) {
		var rows bool
		if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+q(s.name, t)+`)`).Scan(&rows); err != nil {
			return err
		}
		if !rows {
			continue
		}
		if !seeded {
			if _, err := s.pool.Exec(ctx, `CREATE SCHEMA `+q(s.seed)); err != nil {
				return err
			}
			seeded = true
		}
		var cols []string
		err := s.pool.QueryRow(ctx, `SELECT coalesce(array_agg(quote_ident(attname) ORDER BY attnum), '{}') FROM pg_attribute
			WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped AND attgenerated = ''`, q(s.name, t)).Scan(&cols)
		if err != nil {
			return err
		}
		list := strings.Join(cols, ", ")
		if _, err := s.pool.Exec(ctx, `CREATE TABLE `+q(s.seed, t)+` AS SELECT `+list+` FROM `+q(s.name, t)); err != nil {
			return err
		}
		script = append(script, `INSERT INTO `+q(s.name, t)+` (`+list+`) OVERRIDING SYSTEM VALUE SELECT `+list+` FROM `+q(s.seed, t))
	}
	if !ok && seeded {
		// Without a safe order, let the rows go back in with the
		// foreign keys checked at commit.
		script = append([]string{"SET CONSTRAINTS ALL DEFERRED"}, script...)
	}
	rows, err = s.pool.Query(ctx, `SELECT sequencename, coalesce(last_value, start_value), last_value IS NOT NULL FROM pg_sequences WHERE schemaname = $1`, s.name)
	if err != nil {
		return err
	}
	seqs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
		Name   string
		Value  int64
		Called bool
	}])
	if err != nil {
		return err
	}
	for _, sq := range seqs {
		script = append(script, fmt.Sprintf("SELECT setval('%s', %d, %t)", strings.ReplaceAll(q(s.name, sq.Name), "'", "''"), sq.Value, sq.Called))
	}
	s.resetSQL = "BEGIN;\n" + strings.Join(script, ";\n") + ";\nCOMMIT"
	return nil
}

// childrenFirst orders tables so that a table referencing another comes
// before it; ok is false when foreign keys form a cycle.
func childrenFirst(tables []string, refs []struct{ From, To string }) ([]string, bool) {
	referencedBy := map[string]int{}
	for _, r := range refs {
		referencedBy[r.To]++
	}
	var order []string
	done := map[string]bool{}
	for len(order) < len(tables) {
		progress := false
		for _, t := range tables {
			if done[t] || referencedBy[t] > 0 {
				continue
			}
			done[t], progress = true, true
			order = append(order, t)
			for _, r := range refs {
				if r.From == t {
					referencedBy[r.To]--
				}
			}
		}
		if !progress {
			return tables, false
		}
	}
	return order, true
}

// reset restores the state right after Setup. Nothing else may use the
// schema meanwhile.
func (s *schemaEnv) reset(ctx context.Context) error {
	rctx, cancel := context.WithTimeout(ctx, schemaTimeout)
	defer cancel()
	if _, err := s.pool.Exec(rctx, s.resetSQL); err != nil {
		return fmt.Errorf("eventlinetest: reset schema %s to the state after Setup: %w", s.name, err)
	}
	return nil
}

// close closes the pool and drops the schemas. It works after ctx ended.
func (s *schemaEnv) close(ctx context.Context) {
	s.pool.Close()
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), schemaTimeout)
	defer cancel()
	conn, err := pgx.Connect(dctx, s.url)
	if err != nil {
		return
	}
	defer conn.Close(dctx)
	_, _ = conn.Exec(dctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{s.name}.Sanitize()+`, `+pgx.Identifier{s.seed}.Sanitize()+` CASCADE`)
}

// read runs fn in a read-only transaction on the schema.
func (s *schemaEnv) read(ctx context.Context, fn func(context.Context, pgx.Tx) (any, error)) (any, error) {
	var out any
	err := pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		var err error
		out, err = fn(ctx, tx)
		return err
	})
	return out, err
}

func redact(url string) string {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return "the configured database"
	}
	return fmt.Sprintf("%s:%d/%s", cfg.Host, cfg.Port, cfg.Database)
}
