package producer

import (
	"context"
	stdsql "database/sql"
	"encoding/json"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
)

// Metadata keys the relay's schema adapter adds to each outbox message so
// the shard knows the row's position. They never leave the relay.
const (
	metaRowTxID   = "_eventline_outbox_txid"
	metaRowOffset = "_eventline_outbox_offset"
	metaMalformed = "_eventline_outbox_malformed"
	// metaRawMetadata keeps a malformed metadata column for the dead letter.
	metaRawMetadata = "_eventline_outbox_raw_metadata"
)

// rowPos is an outbox row's position: watermill-sql orders and acknowledges
// rows by (transaction_id, offset).
type rowPos struct {
	txID   uint64
	offset int64
}

// itemState is what happened to one outbox row in one relay transaction.
type itemState int32

const (
	itemSkipped   itemState = iota // not published in this batch; read again later
	itemInFlight                   // queued on the Kafka producer
	itemDelivered                  // acknowledged by Kafka
	itemFailed                     // publishing failed; see err
	itemDead                       // will be dead-lettered; see deadReason
)

// item tracks one outbox row through a batch.
type item struct {
	b          *batch
	pos        rowPos
	outboxUUID string
	payload    []byte           // the outbox row's payload: the forwarder envelope
	metadata   message.Metadata // the outbox row's metadata column
	rawMeta    []byte           // the metadata column as stored, when it was not a JSON object

	event eventline.Event // decoded once the envelope is unwrapped
	topic string          // destination Kafka topic

	state      itemState
	sent       bool // handed to the Kafka producer, which will call complete
	err        error
	deadReason string
}

// complete is called by the Kafka sink with the publish outcome.
func (it *item) complete(err error) {
	b := it.b
	b.mu.Lock()
	if err == nil {
		it.state = itemDelivered
	} else {
		it.state, it.err = itemFailed, err
		if !isPermanent(err) {
			b.stopped.Store(true)
		}
	}
	b.release()
	b.mu.Unlock()
	b.shard.relay.metrics.observePublish(it, err)
}

// batch is the set of outbox rows one relay transaction read. The
// transaction commits only after every row published in it has a Kafka
// outcome.
type batch struct {
	shard *shardRunner
	mu    sync.Mutex
	items []*item
	// pending counts rows still held by the guard or in flight to Kafka.
	pending int
	// closed is set when the transaction settles; rows the router hands
	// over after that (the subscriber gave up on them while closing) are
	// not registered, so they are neither published nor acknowledged.
	closed  bool
	drained chan struct{} // closed when pending drops to 0 after closed
	// stopped is set once a row could not be published for a reason that
	// may pass (Kafka down, backoff pending); later rows of the batch are
	// skipped so they are not published ahead of it.
	stopped atomic.Bool
}

// register adds the outbox message delivered by watermill-sql to the batch,
// or returns nil when the batch is already settling.
func (b *batch) register(msg *message.Message) *item {
	it := &item{b: b, outboxUUID: msg.UUID, payload: msg.Payload}
	it.pos.txID, _ = strconv.ParseUint(msg.Metadata.Get(metaRowTxID), 10, 64)
	it.pos.offset, _ = strconv.ParseInt(msg.Metadata.Get(metaRowOffset), 10, 64)
	delete(msg.Metadata, metaRowTxID)
	delete(msg.Metadata, metaRowOffset)
	if reason := msg.Metadata.Get(metaMalformed); reason != "" {
		it.state, it.deadReason = itemDead, reason
		it.rawMeta = []byte(msg.Metadata.Get(metaRawMetadata))
		msg.Metadata = message.Metadata{}
	} else if len(msg.Metadata) > 0 {
		// The forwarder replaces msg with the unwrapped event; this map
		// stays the row's own. It is encoded only for a dead letter.
		it.metadata = msg.Metadata
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	b.pending++
	b.items = append(b.items, it)
	return it
}

// release ends one hold on the batch; b.mu is held.
func (b *batch) release() {
	b.pending--
	if b.closed && b.pending == 0 && b.drained != nil {
		close(b.drained)
	}
}

// dead reports whether the row was found unpublishable on arrival.
func (b *batch) dead(it *item) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return it.state == itemDead
}

// settle ends the guard's hold on it; rows handed to Kafka are settled by
// complete instead.
func (b *batch) settle(it *item) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !it.sent {
		b.release()
	}
}

func (b *batch) set(it *item, state itemState, err error, deadReason string) {
	b.mu.Lock()
	it.state, it.err, it.deadReason = state, err, deadReason
	b.mu.Unlock()
}

// wait blocks until every row has an outcome or the timeout passes. Rows
// still in flight after the timeout are treated as failed.
func (b *batch) wait(timeout time.Duration) {
	b.mu.Lock()
	b.closed = true
	if b.pending == 0 {
		b.mu.Unlock()
		return
	}
	b.drained = make(chan struct{})
	b.mu.Unlock()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-b.drained:
	case <-t.C:
		b.mu.Lock()
		for _, it := range b.items {
			if it.state == itemInFlight {
				it.state, it.err = itemFailed, errFlushTimeout
			}
		}
		b.mu.Unlock()
	}
}

// relayBeginner is the database handle given to watermill-sql's subscriber.
// Every transaction it begins carries a fresh batch; committing it first
// settles the batch (see shardRunner.finish).
type relayBeginner struct {
	pool  *pgxpool.Pool
	shard *shardRunner
}

func (rb relayBeginner) BeginTx(ctx context.Context, _ *stdsql.TxOptions) (wsql.Tx, error) {
	// watermill-sql asks for REPEATABLE READ on PostgreSQL: the offsets row
	// lock then fails with a serialization error, instead of reading stale
	// offsets, if another relay moved them meanwhile.
	tx, err := rb.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		return nil, err
	}
	return &relayTx{tx: tx, ctx: ctx, batch: &batch{shard: rb.shard}}, nil
}

func (rb relayBeginner) ExecContext(ctx context.Context, query string, args ...any) (wsql.Result, error) {
	tag, err := rb.pool.Exec(ctx, query, args...)
	return wsql.PgxResult{CommandTag: tag}, err
}

func (rb relayBeginner) QueryContext(ctx context.Context, query string, args ...any) (wsql.Rows, error) {
	rows, err := rb.pool.Query(ctx, query, args...)
	return wsql.PgxRows{Rows: rows}, err
}

// relayTx is one relay transaction: the watermill-sql subscriber reads and
// acknowledges rows in it, and eventline settles the batch on commit.
type relayTx struct {
	tx    pgx.Tx
	ctx   context.Context
	batch *batch
}

func (t *relayTx) ExecContext(ctx context.Context, query string, args ...any) (wsql.Result, error) {
	if query == deferredAck {
		return wsql.PgxResult{}, nil // finish writes the position
	}
	tag, err := t.tx.Exec(ctx, query, args...)
	return wsql.PgxResult{CommandTag: tag}, err
}

func (t *relayTx) QueryContext(ctx context.Context, query string, args ...any) (wsql.Rows, error) {
	rows, err := t.tx.Query(ctx, query, args...)
	return wsql.PgxRows{Rows: rows}, err
}

// Commit settles the batch, then commits or rolls back. It reports
// problems through the relay's logs and metrics and returns nil, since
// watermill-sql only logs commit errors: the next read starts from whatever
// position was recorded.
func (t *relayTx) Commit() error {
	t.batch.shard.finish(t)
	return nil
}

func (t *relayTx) Rollback() error {
	t.batch.wait(flushTimeout)
	return t.tx.Rollback(context.WithoutCancel(t.ctx))
}

// relaySchemaAdapter is watermill-sql's PostgreSQL schema adapter, with the
// row position copied into the message metadata for the shard's
// bookkeeping.
type relaySchemaAdapter struct {
	wsql.DefaultPostgreSQLSchema
}

// UnmarshalMessage reads a row like watermill-sql's adapter does, but never
// fails on what a row contains: a row whose metadata is not a JSON object
// (inserted by hand, say) becomes a message marked malformed, which the
// shard dead-letters instead of stalling on it forever.
func (a relaySchemaAdapter) UnmarshalMessage(params wsql.UnmarshalMessageParams) (wsql.Row, error) {
	var r wsql.Row
	var xid wsql.XID8
	if err := params.Row.Scan(&r.Offset, &xid, &r.UUID, &r.Payload, &r.Metadata); err != nil {
		return wsql.Row{}, fmt.Errorf("could not scan message row: %w", err)
	}
	msg := message.NewMessage(string(r.UUID), r.Payload)
	if r.Metadata != nil {
		if err := json.Unmarshal(r.Metadata, &msg.Metadata); err != nil {
			msg.Metadata = message.Metadata{
				metaMalformed:   "metadata column is not a JSON object of strings: " + err.Error(),
				metaRawMetadata: string(r.Metadata),
			}
		}
	}
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	msg.Metadata.Set(metaRowTxID, strconv.FormatUint(uint64(xid), 10))
	msg.Metadata.Set(metaRowOffset, strconv.FormatInt(r.Offset, 10))
	r.Msg = msg
	r.ExtraData = map[string]any{"transaction_id": xid}
	return r, nil
}
