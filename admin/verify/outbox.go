package verify

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
)

// outboxEvent is one event as the outbox knows it: the newest outbox row
// carrying its id in one shard, and what the relay did with it.
type outboxEvent struct {
	eventID       string
	eventType     string
	topic         string
	aggregateType string
	aggregateID   string
	version       int64
	createdAt     time.Time
	// relayed: the relay's position in the shard is at or past the row.
	relayed bool
	// dead: the relay dead-lettered the row and nobody replayed it.
	dead bool
	// retryAttempts and retryError describe a row the relay failed to
	// publish and will try again.
	retryAttempts int
	retryError    string
}

// eventColumns are the columns of the events relation, in order; the
// classification query and the chunked lookup both rely on them.
const eventColumns = `event_id, event_type, topic, aggregate_type, aggregate_id, version, created_at, relayed, dead, retry_attempts, retry_error`

// eventsSQL selects the events of one shard whose outbox row was written in
// the window ($1 since, $2 until), as the relation eventColumns.
//
// The row is the outbox row as watermill-sql stores it: payload is the
// forwarder envelope (destination_topic, uuid = the event id, metadata =
// the eventline envelope). A dead letter that was replayed leaves two rows
// with the same outbox uuid, the dead one and the replayed one: only the
// newest counts. created_at is written in the producer session's time zone
// and read in this session's (the same assumption `eventline cleanup`
// makes).
func eventsSQL(schema string, shard int) string {
	messages := sqlident.Qualify(schema, outbox.Table(shard))
	offsets := sqlident.Qualify(schema, outbox.OffsetsTable(shard))
	// The relay's dead letters, by outbox uuid; dead unless replayed (a
	// discarded one is not delivered either).
	deadLetters := `(SELECT convert_from(message_uuid, 'UTF8') AS outbox_uuid, status <> 'replayed' AS dead FROM ` +
		sqlident.Qualify(schema, "held_events") + ` WHERE kind = 'relay_dead_letter' AND shard = ` + strconv.Itoa(shard) + `)`
	failures := sqlident.Qualify(schema, "relay_failures")
	s := strconv.Itoa(shard)
	return `SELECT e.event_id, e.event_type, e.topic, e.aggregate_type, e.aggregate_id, e.version, e.created_at, e.relayed, e.dead,
		COALESCE(f.attempts, 0) AS retry_attempts, COALESCE(f.last_error, '') AS retry_error
	FROM (
		SELECT r.uuid, env.uuid AS event_id,
			COALESCE(md.event_type, '') AS event_type,
			COALESCE(env.destination_topic, '') AS topic,
			COALESCE(md.aggregate_type, '') AS aggregate_type,
			COALESCE(md.aggregate_id, '') AS aggregate_id,
			CASE WHEN md.aggregate_version ~ '^[0-9]{1,18}$' THEN md.aggregate_version::bigint ELSE 0 END AS version,
			r.created_at::timestamptz AS created_at,
			(o.consumer_group IS NOT NULL AND (r.transaction_id, r."offset") <= (o.last_processed_transaction_id, o.offset_acked)) AS relayed,
			r.dead
		FROM (
			SELECT m.uuid, m.payload, m.created_at, m.transaction_id, m."offset", false AS dead
			FROM ` + messages + ` m
			-- NOT IN over a NOT NULL column: one hashed subplan, however
			-- few dead letters the planner expects.
			WHERE m.uuid::text NOT IN (SELECT outbox_uuid FROM ` + deadLetters + ` d)
			UNION ALL
			SELECT uuid, payload, created_at, transaction_id, "offset", dead FROM (
				SELECT m.uuid, m.payload, m.created_at, m.transaction_id, m."offset", d.dead,
					row_number() OVER (PARTITION BY m.uuid ORDER BY m.transaction_id DESC, m."offset" DESC) AS rn
				FROM ` + messages + ` m
				JOIN (SELECT outbox_uuid, bool_or(dead) AS dead FROM ` + deadLetters + ` d GROUP BY outbox_uuid) d ON d.outbox_uuid = m.uuid
			) x WHERE rn = 1
		) r
		-- One parse of the envelope, one of its metadata: json_to_record
		-- reads the fields it needs and skips the rest (the event body).
		CROSS JOIN LATERAL json_to_record(CASE WHEN json_typeof(r.payload) = 'object' THEN r.payload ELSE '{}' END)
			AS env(uuid text, destination_topic text, metadata json)
		CROSS JOIN LATERAL json_to_record(CASE WHEN json_typeof(env.metadata) = 'object' THEN env.metadata ELSE '{}' END)
			AS md(event_type text, aggregate_type text, aggregate_id text, aggregate_version text)
		LEFT JOIN ` + offsets + ` o ON o.consumer_group = '` + outbox.RelayConsumerGroup + `'
	) e LEFT JOIN ` + failures + ` f ON f.shard = ` + s + ` AND f.outbox_uuid = e.uuid
	WHERE e.event_id IS NOT NULL AND ` + windowSQL("e.created_at", 1, 2)
}

// readOutboxSummary counts one shard's rows in the window, and how many the
// relay has not moved past yet; it adds them to sum and returns the oldest
// pending row's commit time.
func readOutboxSummary(ctx context.Context, tx pgx.Tx, schema string, shard int, w window, sum *OutboxSummary) (*time.Time, error) {
	messages := sqlident.Qualify(schema, outbox.Table(shard))
	offsets := sqlident.Qualify(schema, outbox.OffsetsTable(shard))
	var events, relayed int64
	var oldest *time.Time
	err := tx.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE relayed), min(created_at) FILTER (WHERE NOT relayed)
		FROM (SELECT m.created_at::timestamptz AS created_at,
			(o.consumer_group IS NOT NULL AND (m.transaction_id, m."offset") <= (o.last_processed_transaction_id, o.offset_acked)) AS relayed
			FROM `+messages+` m LEFT JOIN `+offsets+` o ON o.consumer_group = $3) x
		WHERE `+windowSQL("created_at", 1, 2), w.since, w.until, outbox.RelayConsumerGroup).Scan(&events, &relayed, &oldest)
	if err != nil {
		return nil, fmt.Errorf("read outbox shard %d: %w", shard, err)
	}
	sum.Events += events
	sum.Relayed += relayed
	sum.Pending += events - relayed
	return oldest, nil
}

// relayDeadRow is a relay dead letter in held_events (its group is
// empty).
type relayDeadRow struct {
	eventRow
	ID        int64
	Shard     int
	Topic     string
	Reason    string
	LastError string
	Attempts  int
}

// relayDeadSQL reads the relay's dead letters of the window ($1..$2) not
// replayed (held, or discarded), as relayDeadRow, oldest first.
func relayDeadSQL(schema string) string {
	return `SELECT ` + eventColumnsOf("h", "held_at") + `, h.id, h.shard, h.topic, h.reason, coalesce(h.last_error, ''), h.attempts
		FROM ` + sqlident.Qualify(schema, "held_events") + ` h
		WHERE h.kind = 'relay_dead_letter' AND h.status <> 'replayed' AND ` + windowSQL("h.held_at", 1, 2) + ` ORDER BY h.id`
}

// countRetrying counts outbox rows waiting for a publish retry.
func countRetrying(ctx context.Context, tx pgx.Tx, schema string) (int64, error) {
	var n int64
	err := tx.QueryRow(ctx, `SELECT count(*) FROM `+sqlident.Qualify(schema, "relay_failures")).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count relay retries: %w", err)
	}
	return n, nil
}

// scanOutboxEvents streams one shard's events in the window to fn in
// chunks of at most size, for lookups in a separate consumer database.
func scanOutboxEvents(ctx context.Context, tx pgx.Tx, schema string, shard int, w window, size int, fn func([]outboxEvent) error) error {
	rows, err := tx.Query(ctx, eventsSQL(schema, shard), w.since, w.until)
	if err != nil {
		return fmt.Errorf("read outbox shard %d: %w", shard, err)
	}
	defer rows.Close()
	chunk := make([]outboxEvent, 0, size)
	for rows.Next() {
		var e outboxEvent
		if err := rows.Scan(&e.eventID, &e.eventType, &e.topic, &e.aggregateType, &e.aggregateID, &e.version, &e.createdAt,
			&e.relayed, &e.dead, &e.retryAttempts, &e.retryError); err != nil {
			return fmt.Errorf("read outbox shard %d: %w", shard, err)
		}
		chunk = append(chunk, e)
		if len(chunk) == size {
			if err := fn(chunk); err != nil {
				return err
			}
			chunk = chunk[:0]
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read outbox shard %d: %w", shard, err)
	}
	if len(chunk) > 0 {
		return fn(chunk)
	}
	return nil
}

// chunkArgs turns a chunk into the array parameters of chunkEventsSQL.
func chunkArgs(chunk []outboxEvent) []any {
	n := len(chunk)
	ids, eventTypes, topics, types, aggIDs := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	versions, created := make([]int64, n), make([]time.Time, n)
	relayed, dead := make([]bool, n), make([]bool, n)
	attempts, errs := make([]int32, n), make([]string, n)
	for i, e := range chunk {
		ids[i], eventTypes[i], topics[i], types[i], aggIDs[i] = e.eventID, e.eventType, e.topic, e.aggregateType, e.aggregateID
		versions[i], created[i], relayed[i], dead[i] = e.version, e.createdAt, e.relayed, e.dead
		attempts[i], errs[i] = int32(e.retryAttempts), e.retryError
	}
	return []any{ids, eventTypes, topics, types, aggIDs, versions, created, relayed, dead, attempts, errs}
}

// chunkEventsSQL is the events relation over the array parameters of
// chunkArgs, $1 to $11; chunkParams is the first parameter after them.
const chunkEventsSQL = `SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::timestamptz[],
	$8::boolean[], $9::boolean[], $10::integer[], $11::text[]) AS ev(` + eventColumns + `)`

const chunkParams = 12
