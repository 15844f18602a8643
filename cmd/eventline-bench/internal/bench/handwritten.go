package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
)

// The hand-written relay of the seed article (postgres-outbox-lab): an
// outbox table with a status column; a worker claims a batch with FOR
// UPDATE SKIP LOCKED and marks it processing (one UPDATE per row, as in the
// article), commits, publishes each message with a sync Sarama producer and
// marks each one sent in its own statement. Several workers run at once, so
// one aggregate's events can be published out of order.
const (
	handWorkers   = 4
	handBatch     = 100
	handIdlePause = time.Second
)

const handDDL = `CREATE TABLE %[1]s (
	id             BIGSERIAL PRIMARY KEY,
	aggregate_type TEXT NOT NULL,
	aggregate_id   TEXT NOT NULL,
	topic          TEXT NOT NULL,
	payload        JSONB NOT NULL,
	status         TEXT NOT NULL CHECK (status IN ('pending', 'processing', 'sent', 'failed')),
	attempts       INTEGER NOT NULL DEFAULT 0,
	next_run_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
	locked_by      TEXT,
	locked_at      TIMESTAMPTZ,
	last_error     TEXT,
	created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
	sent_at        TIMESTAMPTZ);
CREATE INDEX ON %[1]s (status, next_run_at, id)`

type handOutbox struct {
	schema, table string
	sql           handSQL
}

type handSQL struct {
	insertBatch, claim, markProcessing, markSent, markFailed string
}

func (e *env) newHandOutbox(ctx context.Context) (*handOutbox, func(), error) {
	schema, drop, err := e.newSchema(ctx, "handwritten")
	if err != nil {
		return nil, nil, err
	}
	t := qualify(schema, "outbox_messages")
	if err := e.exec(ctx, fmt.Sprintf(handDDL, t)); err != nil {
		drop()
		return nil, nil, err
	}
	return &handOutbox{schema: schema, table: t, sql: handSQL{
		insertBatch: `INSERT INTO ` + t + ` (aggregate_type, aggregate_id, topic, payload, status)
			SELECT 'order', a, $1, p::jsonb, 'pending' FROM unnest($2::text[], $3::text[]) AS u(a, p)`,
		claim: `SELECT id, aggregate_id, topic, payload::text, attempts FROM ` + t + `
			WHERE status IN ('pending', 'failed') AND next_run_at <= now()
			ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED`,
		markProcessing: `UPDATE ` + t + ` SET status = 'processing', attempts = attempts + 1, locked_by = $2, locked_at = now() WHERE id = $1`,
		markSent:       `UPDATE ` + t + ` SET status = 'sent', sent_at = now() WHERE id = $1`,
		markFailed: `UPDATE ` + t + ` SET status = 'failed', next_run_at = $2, locked_by = NULL, locked_at = NULL, last_error = $3
			WHERE id = $1`,
	}}, drop, nil
}

// handPayload is the article's payload: the event's fields and body as
// one JSON document.
func handPayload(e eventline.Event) string {
	b, _ := json.Marshal(map[string]any{
		"event_id": e.ID, "event_type": e.Type, "aggregate_version": e.AggregateVersion,
		"data": json.RawMessage(e.Payload),
	})
	return string(b)
}

// insert writes events for topic in one statement.
func (o *handOutbox) insert(ctx context.Context, db execer, topic string, events []eventline.Event) error {
	ids := make([]string, len(events))
	payloads := make([]string, len(events))
	for i, e := range events {
		ids[i], payloads[i] = e.AggregateID, handPayload(e)
	}
	_, err := db.Exec(ctx, o.sql.insertBatch, topic, ids, payloads)
	return err
}

type handMessage struct {
	id          int64
	aggregateID string
	topic       string
	payload     string
	attempts    int
}

// handRelay runs the article's RelayOnce in a loop on several workers.
type handRelay struct {
	o        *handOutbox
	pool     *pgxpool.Pool
	producer sarama.SyncProducer
	sent     atomic.Int64
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	errMu    sync.Mutex
	err      error
}

func (o *handOutbox) startRelay(ctx context.Context, pool *pgxpool.Pool, brokers []string) (*handRelay, error) {
	cfg := sarama.NewConfig()
	cfg.ClientID = "handwritten-relay"
	cfg.Version = kafkaVersion
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	p, err := sarama.NewSyncProducer(brokers, cfg)
	if err != nil {
		return nil, fmt.Errorf("hand-written relay producer: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	r := &handRelay{o: o, pool: pool, producer: p, cancel: cancel}
	for i := range handWorkers {
		r.wg.Add(1)
		go func() { defer r.wg.Done(); r.worker(ctx, fmt.Sprintf("relay-%d", i)) }()
	}
	return r, nil
}

func (r *handRelay) close() error {
	r.cancel()
	r.wg.Wait()
	_ = r.producer.Close()
	r.errMu.Lock()
	defer r.errMu.Unlock()
	return r.err
}

func (r *handRelay) fail(err error) {
	r.errMu.Lock()
	if r.err == nil {
		r.err = err
	}
	r.errMu.Unlock()
}

func (r *handRelay) worker(ctx context.Context, id string) {
	for ctx.Err() == nil {
		n, err := r.relayOnce(ctx, id)
		if err != nil {
			if ctx.Err() == nil {
				r.fail(err)
			}
			return
		}
		if n == 0 {
			select {
			case <-ctx.Done():
			case <-time.After(handIdlePause):
			}
		}
	}
}

// relayOnce is the article's RelayOnce: claim, publish, mark.
func (r *handRelay) relayOnce(ctx context.Context, id string) (int, error) {
	msgs, err := r.claim(ctx, id)
	if err != nil || len(msgs) == 0 {
		return 0, err
	}
	for _, m := range msgs {
		_, _, err := r.producer.SendMessage(&sarama.ProducerMessage{
			Topic: m.topic, Key: sarama.StringEncoder(m.aggregateID), Value: sarama.StringEncoder(m.payload),
		})
		if err != nil {
			if _, err := r.pool.Exec(ctx, r.o.sql.markFailed, m.id, time.Now().Add(2*time.Second), err.Error()); err != nil {
				return 0, fmt.Errorf("mark failed: %w", err)
			}
			continue
		}
		if _, err := r.pool.Exec(ctx, r.o.sql.markSent, m.id); err != nil {
			return 0, fmt.Errorf("mark sent: %w", err)
		}
		r.sent.Add(1)
	}
	return len(msgs), nil
}

func (r *handRelay) claim(ctx context.Context, id string) ([]handMessage, error) {
	var msgs []handMessage
	err := pgx.BeginTxFunc(ctx, r.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, r.o.sql.claim, handBatch)
		if err != nil {
			return err
		}
		msgs, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (handMessage, error) {
			var m handMessage
			return m, row.Scan(&m.id, &m.aggregateID, &m.topic, &m.payload, &m.attempts)
		})
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if _, err := tx.Exec(ctx, r.o.sql.markProcessing, m.id, id); err != nil {
				return fmt.Errorf("claim outbox message %d: %w", m.id, err)
			}
		}
		return nil
	})
	return msgs, err
}
