package migrations

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/sqlident"
)

// unresolvedSQL counts, per migration version, the rows its rollback
// drops although they still wait for a consumer or an operator; the table
// is looked for first, so a migration not applied counts none.
var unresolvedSQL = map[int]struct{ table, count string }{
	2: {"parked_events", `SELECT count(*) FROM {schema}.parked_events`},
	3: {"held_events", `SELECT count(*) FROM {schema}.held_events WHERE status IN ('held', 'replay_requested')`},
}

// Unresolved counts the rows that rolling back migration version would
// drop while they still wait for a consumer or an operator: parked events
// (002_consumer) and held events not yet replayed or discarded
// (003_held_events: the relay's and the consumers' dead letters, late
// events). The outbox's events not yet relayed are admin.ReadOutboxStatus's
// to count; the other migrations hold none of these, and a migration not
// applied holds none. `eventline migrate down` refuses to drop any without
// -force.
func Unresolved(ctx context.Context, db Beginner, cfg Config, version int) (int64, error) {
	cfg, err := cfg.checked("migrations.Unresolved", db)
	if err != nil {
		return 0, err
	}
	q, ok := unresolvedSQL[version]
	if !ok {
		return 0, nil
	}
	var n int64
	err = pgx.BeginTxFunc(ctx, db, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, sqlident.Qualify(cfg.Schema, q.table)).Scan(&exists); err != nil || !exists {
			return err
		}
		return tx.QueryRow(ctx, sqlident.SQL(cfg.Schema, q.count)).Scan(&n)
	})
	if err != nil {
		return 0, fmt.Errorf("count the %s rolling back migration %03d would drop: %w", q.table, version, err)
	}
	return n, nil
}
