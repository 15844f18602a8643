package verify

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/outbox"
)

// outboxEvent is one event as the outbox knows it: the newest outbox row
// carrying its id in one shard, and what the relay did with it. Its
// fields are the columns of the events relation (eventsSQL,
// chunkEventsSQL), in order, and their JSON names chunkEventsSQL's.
type outboxEvent struct {
	EventID       string    `json:"event_id"`
	EventType     string    `json:"event_type"`
	Topic         string    `json:"topic"`
	AggregateType string    `json:"aggregate_type"`
	AggregateID   string    `json:"aggregate_id"`
	Version       int64     `json:"version"`
	CreatedAt     time.Time `json:"created_at"`
	// Relayed: the relay's position in the shard is at or past the row.
	Relayed bool `json:"relayed"`
	// Dead: the relay dead-lettered the row and nobody replayed it.
	Dead bool `json:"dead"`
	// RetryAttempts and RetryError describe a row the relay failed to
	// publish and will try again.
	RetryAttempts int32  `json:"retry_attempts"`
	RetryError    string `json:"retry_error"`
}

// relayedSQL is true for a row of {messages} m the relay's position
// ({offsets} o) is at or past.
const relayedSQL = `(o.consumer_group IS NOT NULL AND (m.transaction_id, m."offset") <= (o.last_processed_transaction_id, o.offset_acked))`

// eventsSQL selects the events of one shard whose outbox row was written in
// the window ($1 since, $2 until), as the relation of outboxEvent.
//
// The row is the outbox row as watermill-sql stores it: payload is the
// forwarder envelope (destination_topic, uuid = the event id, metadata =
// the eventline envelope). A dead letter that was replayed leaves two rows
// with the same outbox uuid, the dead one and the replayed one: only the
// newest counts. created_at is written in the producer session's time zone
// and read in this session's (the same assumption `eventline cleanup`
// makes).
func eventsSQL(schema string, shard int) string {
	return outbox.SQL(schema, shard, `SELECT e.event_id, e.event_type, e.topic, e.aggregate_type, e.aggregate_id, e.version, e.created_at, e.relayed, e.dead,
		COALESCE(f.attempts, 0) AS retry_attempts, COALESCE(f.last_error, '') AS retry_error
	FROM (
		SELECT m.uuid, env.uuid AS event_id,
			COALESCE(md.event_type, '') AS event_type,
			COALESCE(env.destination_topic, '') AS topic,
			COALESCE(md.aggregate_type, '') AS aggregate_type,
			COALESCE(md.aggregate_id, '') AS aggregate_id,
			CASE WHEN md.aggregate_version ~ '^[0-9]{1,18}$' THEN md.aggregate_version::bigint ELSE 0 END AS version,
			m.created_at::timestamptz AS created_at, `+relayedSQL+` AS relayed, m.dead
		FROM (
			SELECT m.uuid, m.payload, m.created_at, m.transaction_id, m."offset", false AS dead
			FROM {messages} m
			-- NOT IN over a NOT NULL column: one hashed subplan, however
			-- few dead letters the planner expects.
			WHERE m.uuid::text NOT IN (SELECT outbox_uuid FROM `+relayDeadLettersSQL+` d)
			UNION ALL
			SELECT uuid, payload, created_at, transaction_id, "offset", dead FROM (
				SELECT m.uuid, m.payload, m.created_at, m.transaction_id, m."offset", d.dead,
					row_number() OVER (PARTITION BY m.uuid ORDER BY m.transaction_id DESC, m."offset" DESC) AS rn
				FROM {messages} m
				JOIN (SELECT outbox_uuid, bool_or(dead) AS dead FROM `+relayDeadLettersSQL+` d GROUP BY outbox_uuid) d ON d.outbox_uuid = m.uuid
			) x WHERE rn = 1
		) m
		-- One parse of the envelope, one of its metadata: json_to_record
		-- reads the fields it needs and skips the rest (the event body).
		CROSS JOIN LATERAL json_to_record(CASE WHEN json_typeof(m.payload) = 'object' THEN m.payload ELSE '{}' END)
			AS env(uuid text, destination_topic text, metadata json)
		CROSS JOIN LATERAL json_to_record(CASE WHEN json_typeof(env.metadata) = 'object' THEN env.metadata ELSE '{}' END)
			AS md(event_type text, aggregate_type text, aggregate_id text, aggregate_version text)
		LEFT JOIN {offsets} o ON o.consumer_group = '`+outbox.RelayConsumerGroup+`'
	) e LEFT JOIN {schema}.relay_failures f ON f.shard = {shard} AND f.outbox_uuid = e.uuid
	WHERE e.event_id IS NOT NULL AND `+windowSQL("e.created_at"))
}

// relayDeadLettersSQL is the relay's dead letters of a shard, by outbox
// uuid; dead unless replayed (a discarded one is not delivered either).
const relayDeadLettersSQL = `(SELECT convert_from(message_uuid, 'UTF8') AS outbox_uuid, status <> 'replayed' AS dead FROM {schema}.held_events
	WHERE kind = 'relay_dead_letter' AND shard = {shard})`

// outboxSummarySQL counts one shard's rows in the window, those the relay
// has moved past, and returns the oldest pending row's commit time ($3 the
// relay's consumer group).
var outboxSummarySQL = `SELECT count(*), count(*) FILTER (WHERE relayed), min(created_at) FILTER (WHERE NOT relayed)
	FROM (SELECT m.created_at::timestamptz AS created_at, ` + relayedSQL + ` AS relayed
		FROM {messages} m LEFT JOIN {offsets} o ON o.consumer_group = $3) x
	WHERE ` + windowSQL("created_at")

// scanOutboxEvents streams one shard's events in the window to fn in
// chunks of at most size, for lookups in a separate consumer database.
func scanOutboxEvents(ctx context.Context, tx pgx.Tx, schema string, shard int, since, until *time.Time, size int, fn func([]outboxEvent) error) error {
	rows, err := tx.Query(ctx, eventsSQL(schema, shard), since, until)
	if err != nil {
		return fmt.Errorf("read outbox shard %d: %w", shard, err)
	}
	defer rows.Close()
	chunk := make([]outboxEvent, 0, size)
	for rows.Next() {
		e, err := pgx.RowToStructByPos[outboxEvent](rows)
		if err != nil {
			return fmt.Errorf("read outbox shard %d: %w", shard, err)
		}
		if chunk = append(chunk, e); len(chunk) == size {
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

// chunkEventsSQL is the events relation over a chunk of outboxEvent,
// passed as JSON in $1; chunkParams is the first parameter after it.
const chunkEventsSQL = `SELECT * FROM jsonb_to_recordset($1::jsonb) AS ev(event_id text, event_type text, topic text, aggregate_type text,
	aggregate_id text, version bigint, created_at timestamptz, relayed boolean, dead boolean, retry_attempts integer, retry_error text)`

const chunkParams = 2
