package admin

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
)

// DeadLetter is an outbox message the relay gave up on.
type DeadLetter struct {
	ID               int64
	Shard            int
	OutboxUUID       string
	EventID          string
	EventType        string
	AggregateType    string
	AggregateID      string
	AggregateVersion int64
	Topic            string
	Attempts         int
	LastError        string
	Reason           string
	DeadAt           time.Time
	// ReplayedAt is set once the message was re-enqueued.
	ReplayedAt *time.Time
}

// DeadLetterFilter selects dead letters for ListDeadLetters.
type DeadLetterFilter struct {
	// IncludeReplayed lists replayed ones too. Defaults to false.
	IncludeReplayed bool
	// Limit caps the result. Defaults to 100.
	Limit int
}

// listDeadLettersSQL lists dead letters ($1 replayed ones too), oldest
// first, at most $2.
const listDeadLettersSQL = `SELECT id, shard, outbox_uuid, event_id, event_type, aggregate_type, aggregate_id,
		aggregate_version, destination_topic, attempts, last_error, dead_reason, dead_at, replayed_at
	FROM {schema}.dead_letters
	WHERE $1 OR replayed_at IS NULL ORDER BY id LIMIT $2`

// ListDeadLetters returns the relay's dead letters in schema, oldest
// first.
func ListDeadLetters(ctx context.Context, db DBTX, schema string, f DeadLetterFilter) ([]DeadLetter, error) {
	if err := checkArgs("ListDeadLetters", db, schema); err != nil {
		return nil, err
	}
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := db.Query(ctx, sqlident.SQL(schema, listDeadLettersSQL), f.IncludeReplayed, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (DeadLetter, error) {
		var d DeadLetter
		err := row.Scan(&d.ID, &d.Shard, &d.OutboxUUID, &d.EventID, &d.EventType, &d.AggregateType, &d.AggregateID,
			&d.AggregateVersion, &d.Topic, &d.Attempts, &d.LastError, &d.Reason, &d.DeadAt, &d.ReplayedAt)
		return d, err
	})
}

// selectForReplaySQL locks the dead letters waiting for replay, of the ids
// $1 or all when it is empty, in the order they died.
const selectForReplaySQL = `SELECT id, shard, outbox_uuid, payload::text, metadata::text FROM {schema}.dead_letters
	WHERE replayed_at IS NULL AND (cardinality($1::bigint[]) = 0 OR id = ANY($1))
	ORDER BY id FOR UPDATE`

// markReplayedSQL marks dead letter $1 replayed.
const markReplayedSQL = `UPDATE {schema}.dead_letters SET replayed_at = now() WHERE id = $1`

// ReplayDeadLetters puts dead letters back into their outbox shard, with
// the same envelope: same event id, same aggregate version, same topic.
// With no ids it replays every dead letter not yet replayed. All of them
// are re-enqueued in one transaction, in the order they died, and marked
// replayed; the relay then publishes them like new rows. Consumers that
// parked later versions of the same aggregate apply them once the replayed
// event fills the gap.
func ReplayDeadLetters(ctx context.Context, db Beginner, schema string, ids ...int64) (int, error) {
	if err := checkArgs("ReplayDeadLetters", db, schema); err != nil {
		return 0, err
	}
	if ids == nil {
		ids = []int64{} // NULL would match nothing
	}
	markReplayed := sqlident.SQL(schema, markReplayedSQL)
	replayed := 0
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, sqlident.SQL(schema, selectForReplaySQL), ids)
		if err != nil {
			return fmt.Errorf("select dead letters: %w", err)
		}
		type dl struct {
			id                int64
			shard             int
			uuid              string
			payload, metadata *string
		}
		letters, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (dl, error) {
			var d dl
			return d, row.Scan(&d.id, &d.shard, &d.uuid, &d.payload, &d.metadata)
		})
		if err != nil {
			return err
		}
		if len(letters) == 0 {
			return ErrNoDeadLetters
		}
		pub, err := wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: outbox.SchemaAdapter(schema, 0)}, nil)
		if err != nil {
			return err
		}
		for _, d := range letters {
			var payload []byte
			if d.payload != nil {
				payload = []byte(*d.payload)
			}
			msg := message.NewMessage(d.uuid, payload)
			if d.metadata != nil {
				// Metadata that is not a string map was malformed on the way in;
				// it is replayed without it.
				_ = json.Unmarshal([]byte(*d.metadata), &msg.Metadata)
			}
			msg.SetContext(ctx)
			if err := pub.Publish(outbox.Topic(d.shard), msg); err != nil {
				return fmt.Errorf("re-enqueue dead letter %d: %w", d.id, err)
			}
			if _, err := tx.Exec(ctx, markReplayed, d.id); err != nil {
				return err
			}
			replayed++
		}
		return nil
	})
	return replayed, err
}
