package admin

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgerr"
	"github.com/eventline/eventline/internal/sqlident"
)

// Moving an outbox to another PostgreSQL cluster (pg_dump and restore, a
// logical-replication cutover) keeps the rows' transaction_id and the
// relays' positions, which are transaction ids of the old cluster. When the
// new cluster's transaction counter is lower, rows written there sort below
// the stored position and are never relayed, and the old rows that were not
// relayed yet stay invisible (above the new cluster's xmin horizon): the
// relay stops without an error. This file detects that and re-bases the
// positions.

// PositionCheck compares a shard's relay position and newest row with the
// cluster's transaction counter.
type PositionCheck struct {
	Shard int
	// Position is the relay's position: the transaction id of the last row
	// relayed (0 before the first).
	Position uint64
	// NewestRow is the highest transaction id among the shard's rows.
	NewestRow uint64
	// Counter is the next transaction id this cluster will hand out
	// (pg_snapshot_xmax of a fresh snapshot).
	Counter uint64
}

// Ahead reports whether the position or a row carries a transaction id
// this cluster has not handed out: the outbox was moved from a cluster
// with a higher counter, and the shard needs RebasePositions.
func (c PositionCheck) Ahead() bool { return outbox.Position(c).Ahead() }

// CheckPositions compares every shard's position and rows with the
// cluster's transaction counter; see PositionCheck.Ahead.
func CheckPositions(ctx context.Context, db DBTX, schema string) ([]PositionCheck, error) {
	if err := checkArgs("CheckPositions", db, schema); err != nil {
		return nil, err
	}
	shards, err := outbox.ShardCount(ctx, db, schema)
	if err != nil {
		return nil, err
	}
	out := make([]PositionCheck, 0, shards)
	for shard := 0; shard < shards; shard++ {
		c, err := outbox.CheckPosition(ctx, db, schema, shard)
		if err != nil {
			return nil, err
		}
		out = append(out, PositionCheck(c))
	}
	return out, nil
}

// RebaseResult is what RebasePositions did (or would do) to one shard.
type RebaseResult struct {
	PositionCheck
	// Relayed counts rows from the old cluster that were relayed before
	// the move (at or before the position); they keep being treated as
	// relayed.
	Relayed int64
	// Pending counts rows from the old cluster that were not relayed yet;
	// they are relayed first, in insertion order.
	Pending int64
}

// RebasePositions repairs the shards whose position or rows are ahead of
// this cluster's transaction counter (see CheckPositions), each in one
// transaction holding the shard's read fence, so a running relay waits:
//
//   - rows carrying a transaction id this cluster has not handed out get
//     transaction id 0 if they were relayed before the move, 1 if not;
//   - the position becomes (0, the highest offset among rows now at 0).
//
// Afterwards the relay sends the old rows it had not sent (in insertion
// order), then every row written on this cluster. Rows relayed before the
// move whose transaction id is below this cluster's counter are sent
// again: consumers skip them as duplicates. Shards that are not ahead are
// left alone. With dryRun it only reports.
//
// Producers may keep writing meanwhile: nothing they commit is marked
// relayed. The counter that decides which rows are re-based, the rows and
// the position are read and written by one statement, under one snapshot.
// A row of this cluster carries its transaction's id; an id at or above
// that snapshot's xmax belongs to a transaction the snapshot does not see
// (still running, or not started, when the statement began), so its rows
// are invisible to the statement and keep their id; every other row of
// this cluster has an id below the counter and is not touched. Either way
// the row sorts after the new position and is relayed.
func RebasePositions(ctx context.Context, db Beginner, schema string, dryRun bool) ([]RebaseResult, error) {
	if err := checkArgs("RebasePositions", db, schema); err != nil {
		return nil, err
	}
	var shards int
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var err error
		shards, err = outbox.ShardCount(ctx, tx, schema)
		return err
	})
	if err != nil {
		return nil, err
	}
	fenceNS := outbox.FenceNamespace(schema)
	var out []RebaseResult
	for shard := 0; shard < shards; shard++ {
		var res RebaseResult
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1::int, $2::int)`, fenceNS, shard); err != nil {
				return fmt.Errorf("take shard %d's read fence: %w", shard, err)
			}
			// A cheap look first, so shards that are fine are left alone.
			c, err := outbox.CheckPosition(ctx, tx, schema, shard)
			if err != nil {
				return err
			}
			res.PositionCheck = PositionCheck(c)
			if !c.Ahead() {
				return nil
			}
			if hook := rebaseHook.Load(); hook != nil {
				(*hook)(schema, shard)
			}
			// The counter read above is stale by now: a producer may have
			// taken an id at or above it and committed since. The re-base
			// reads its own, in the statement that moves the rows.
			var pos, newest, counter string
			err = tx.QueryRow(ctx, outbox.SQL(schema, shard, rebaseSQL), outbox.RelayConsumerGroup).
				Scan(&pos, &newest, &counter, &res.Relayed, &res.Pending)
			if err != nil {
				return fmt.Errorf("re-base shard %d: %w", shard, err)
			}
			res.Position, _ = strconv.ParseUint(pos, 10, 64)
			res.NewestRow, _ = strconv.ParseUint(newest, 10, 64)
			res.Counter, _ = strconv.ParseUint(counter, 10, 64)
			if dryRun {
				return errDryRun
			}
			return nil
		})
		if err != nil && !errors.Is(err, errDryRun) {
			return out, err
		}
		out = append(out, res)
	}
	return out, nil
}

// rebaseHook, when set (by tests), runs in RebasePositions after a shard
// was found ahead and before it is re-based.
var rebaseHook atomic.Pointer[func(schema string, shard int)]

// rebaseSQL re-bases one shard ($1 the relay's consumer group) in one
// statement, so the counter it compares ids with comes from the snapshot
// its reads and writes use (see RebasePositions): it returns position,
// newest row and counter as text, and the rows it marked relayed and
// pending. Rows are classified by their original ids; the position is the
// highest offset among the rows at 0, those moved there now and those a
// previous re-base left there (the statement does not see its own
// update).
const rebaseSQL = `WITH pos AS (
		SELECT last_processed_transaction_id AS xid, offset_acked AS off FROM {offsets} WHERE consumer_group = $1
	), chk AS (
		SELECT COALESCE((SELECT xid FROM pos), '0'::xid8) AS position,
			COALESCE((SELECT max(transaction_id) FROM {messages}), '0'::xid8) AS newest,
			pg_snapshot_xmax(pg_current_snapshot()) AS counter
	), ahead AS (
		SELECT counter FROM chk WHERE position >= counter OR newest >= counter
	), moved AS (
		UPDATE {messages} m
		SET transaction_id = CASE WHEN pos.xid IS NOT NULL AND (m.transaction_id, m."offset") <= (pos.xid, pos.off) THEN '0'::xid8 ELSE '1'::xid8 END
		FROM ahead LEFT JOIN pos ON true
		WHERE m.transaction_id >= ahead.counter
		RETURNING m.transaction_id = '0'::xid8 AS relayed, m."offset" AS off
	), positioned AS (
		INSERT INTO {offsets} (consumer_group, offset_acked, last_processed_transaction_id)
		SELECT $1, GREATEST(COALESCE((SELECT max(off) FROM moved WHERE relayed), 0),
			COALESCE((SELECT max("offset") FROM {messages} WHERE transaction_id = '0'::xid8), 0)), '0'::xid8
		FROM ahead
		ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = excluded.offset_acked, last_processed_transaction_id = excluded.last_processed_transaction_id
	)
	SELECT position::text, newest::text, counter::text,
		(SELECT count(*) FROM moved WHERE relayed), (SELECT count(*) FROM moved WHERE NOT relayed)
	FROM chk`

// SequenceAdvance is what AdvanceSequences did (or would do).
type SequenceAdvance struct {
	// Aggregates counts the aggregates consumers have seen.
	Aggregates int64
	// Advanced counts those whose sequence was behind and was moved up.
	Advanced int64
	// KeysTooLong counts aggregates left out because their type and id
	// are too long for PostgreSQL's index on aggregate_sequences (a
	// hostile record a consumer dead-lettered): no producer can publish
	// such an aggregate, so no new event can reuse its versions.
	KeysTooLong int64
}

// AdvanceSequences moves every aggregate's producer sequence
// (aggregate_sequences) up to the highest version any consumer group holds
// for it, so the producer never hands out a version consumers have already
// seen. Run it after a failover that lost commits (asynchronous
// replication): the outbox and the sequences rolled back, the consumers did
// not, and new events would otherwise reuse versions the consumers discard
// as stale.
//
// A version is held wherever a consumer can keep it: applied
// (aggregate_versions), parked (parked_events), and held late or
// dead-lettered (held_events of those kinds, whatever their status: a
// discarded event's version was still used by an event, and a replayed
// one's is applied or held elsewhere, so counting it costs nothing). Dead
// letters whose envelope did not decode carry no version and do not count.
//
// consumerDB and consumerSchema hold the consumer groups' tables: the
// producer's own database and schema when producer and consumers share
// one, or the consumers' database otherwise (run it once per consumer
// database). Sequences only ever move up. With dryRun nothing is written.
func AdvanceSequences(ctx context.Context, producerDB Beginner, schema string, consumerDB DBTX, consumerSchema string, dryRun bool) (SequenceAdvance, error) {
	var res SequenceAdvance
	if err := checkDB("AdvanceSequences", "consumerDB", consumerDB); err != nil {
		return res, err
	}
	if err := checkDB("AdvanceSequences", "producerDB", producerDB); err != nil {
		return res, err
	}
	if err := sqlident.Validate("admin.AdvanceSequences: schema", schema); err != nil {
		return res, err
	}
	if err := sqlident.Validate("admin.AdvanceSequences: consumerSchema", consumerSchema); err != nil {
		return res, err
	}
	var types, ids []string
	var versions []int64
	var typ, id string
	var v int64
	rows, err := consumerDB.Query(ctx, sqlident.SQL(consumerSchema, heldVersionsSQL))
	if err == nil {
		_, err = pgx.ForEachRow(rows, []any{&typ, &id, &v}, func() error {
			types, ids, versions = append(types, typ), append(ids, id), append(versions, v)
			return nil
		})
	}
	if err != nil {
		return res, fmt.Errorf("read the versions consumers have seen: %w", err)
	}
	res.Aggregates = int64(len(types))
	const chunk = 10_000
	advance := sqlident.SQL(schema, advanceSQL)
	err = pgx.BeginFunc(ctx, producerDB, func(tx pgx.Tx) error {
		for start := 0; start < len(types); start += chunk {
			end := min(start+chunk, len(types))
			n, err := advanceChunk(ctx, tx, advance, types[start:end], ids[start:end], versions[start:end])
			if isKeyTooLong(err) {
				// One aggregate's key is too long for the index: go one by
				// one and leave those out.
				n, err = 0, nil
				for i := start; i < end && err == nil; i++ {
					var one int64
					one, err = advanceChunk(ctx, tx, advance, types[i:i+1], ids[i:i+1], versions[i:i+1])
					if isKeyTooLong(err) {
						one, err = 0, nil
						res.KeysTooLong++
					}
					n += one
				}
			}
			if err != nil {
				return fmt.Errorf("advance aggregate sequences: %w", err)
			}
			res.Advanced += n
		}
		if dryRun {
			return errDryRun
		}
		return nil
	})
	if err != nil && !errors.Is(err, errDryRun) {
		return res, err
	}
	return res, nil
}

// advanceChunk moves the sequences of one chunk of aggregates up, in a
// savepoint of tx, and returns how many moved.
func advanceChunk(ctx context.Context, tx pgx.Tx, advance string, types, ids []string, versions []int64) (int64, error) {
	var n int64
	err := pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		return sp.QueryRow(ctx, advance, types, ids, versions).Scan(&n)
	})
	return n, err
}

// advanceSQL moves the sequences of the aggregates ($1 types, $2 ids) up
// to the versions ($3) where they are behind, and counts those it moved.
const advanceSQL = `WITH seen AS (
		SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[]) AS s(aggregate_type, aggregate_id, version)
	), up AS (
		INSERT INTO {schema}.aggregate_sequences AS q (aggregate_type, aggregate_id, version)
		SELECT aggregate_type, aggregate_id, version FROM seen
		ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET version = excluded.version
		WHERE q.version < excluded.version
		RETURNING 1
	) SELECT count(*) FROM up`

// isKeyTooLong reports PostgreSQL refusing an index entry as too large
// (SQLSTATE 54000, program_limit_exceeded).
func isKeyTooLong(err error) bool { return pgerr.HasCode(err, pgerr.ProgramLimitExceeded) }

// heldVersionsSQL reads the highest version consumers hold per aggregate
// (type, id, version), over the tables that can hold one (see
// AdvanceSequences). A dead letter whose envelope did not decode has
// version 0 and no aggregate; the relay's hold no version of a group.
const heldVersionsSQL = `SELECT aggregate_type, aggregate_id, max(version) FROM (
		SELECT aggregate_type, aggregate_id, version FROM {schema}.aggregate_versions
		UNION ALL
		SELECT aggregate_type, aggregate_id, aggregate_version FROM {schema}.parked_events
		UNION ALL
		SELECT aggregate_type, aggregate_id, aggregate_version FROM {schema}.held_events
		WHERE kind IN ('dead_letter', 'late') AND aggregate_id <> ''
	) seen WHERE version > 0 GROUP BY aggregate_type, aggregate_id`
