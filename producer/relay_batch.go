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
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/tracing"
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
	b *batch
	// txID and offset are the row's position: watermill-sql orders and
	// acknowledges rows by (transaction_id, offset).
	txID       string
	offset     int64
	outboxUUID string
	payload    []byte           // the outbox row's payload: the forwarder envelope
	metadata   message.Metadata // the outbox row's metadata column
	rawMeta    []byte           // the metadata column as stored, when it was not a JSON object

	event eventline.Event // decoded once the envelope is unwrapped
	topic string          // destination Kafka topic

	span trace.Span // the send span, nil when tracing is off

	state itemState
	sent  bool // handed to the Kafka producer, which will call complete
	// alone: published as the only row of its transaction, so Kafka
	// cannot have batched it with others (a retry after a batch that
	// Kafka refused as too large, see failBatchTooLarge).
	alone      bool
	err        error
	deadReason string
	deadCause  string // held.Cause*: set when the publish failed for good; else the row is malformed
}

// endSpan ends the item's send span, if any, with Kafka's answer: the
// record's partition and offset, or the error.
func (it *item) endSpan(partition int32, offset int64, err error) {
	sp := it.span
	if sp == nil {
		return
	}
	it.span = nil
	if err == nil {
		sp.SetAttributes(tracing.AttrPartition.String(strconv.Itoa(int(partition))), tracing.AttrOffset.Int64(offset))
	}
	tracing.End(sp, err)
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
	it.txID = msg.Metadata.Get(metaRowTxID)
	it.offset, _ = strconv.ParseInt(msg.Metadata.Get(metaRowOffset), 10, 64)
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

// wait blocks until every row has an outcome, flushTimeout passes or ctx
// ends (the shard stopped and its grace ran out, or its lease was lost).
// Rows still in flight then are treated as failed: they are published
// again, by this relay or the next owner.
func (b *batch) wait(ctx context.Context) {
	b.mu.Lock()
	b.closed = true
	if b.pending == 0 {
		b.mu.Unlock()
		return
	}
	b.drained = make(chan struct{})
	b.mu.Unlock()
	t := time.NewTimer(flushTimeout)
	defer t.Stop()
	select {
	case <-b.drained:
	case <-t.C:
		b.abandon(errFlushTimeout)
	case <-ctx.Done():
		b.abandon(errShardStopped)
	}
}

func (b *batch) abandon(err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, it := range b.items {
		if it.state == itemInFlight {
			it.state, it.err = itemFailed, err
		}
	}
}

// relayBeginner is the database handle given to watermill-sql's subscriber.
// Every transaction it begins carries a fresh batch; committing it first
// settles the batch (see shardRunner.finish).
type relayBeginner struct{ shard *shardRunner }

// BeginTx takes a connection for a relay transaction; the transaction
// itself begins with its first statement, in the same round trip
// (relayTx.begin). Its statements do not run under the subscriber's
// context, which the router cancels the moment the shard is asked to stop
// (a query cut off that way closes the connection, and the batch's
// progress could not be recorded): they run under the shard's hard
// context, which ends only when the lease is lost or the stop grace ran
// out, and the transaction's own deadline (txTimeout).
func (rb relayBeginner) BeginTx(_ context.Context, _ *stdsql.TxOptions) (wsql.Tx, error) {
	s := rb.shard
	if s.stopping() {
		return nil, errShardStopped
	}
	ctx, cancel := context.WithTimeout(s.hard, txTimeout)
	conn, err := s.relay.pool.Acquire(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	return &relayTx{conn: conn, ctx: ctx, cancel: cancel, batch: &batch{shard: s}}, nil
}

// relaySettings are a relay transaction's settings, as select-list
// expressions of its read (nextOffsetSQL), so they cost no statement of
// their own. PostgreSQL ends the transaction after as long idle
// (idle_in_transaction_session_timeout), in case the relay vanishes
// holding the shard's fence. Its commit does not wait for the WAL flush
// (synchronous_commit = off): what it writes only lets the relay skip work,
// so losing it in a crash means publishing again (docs/DESIGN.md, "Relay").
var relaySettings = fmt.Sprintf(`set_config('idle_in_transaction_session_timeout', '%d', true) AS idle_timeout, set_config('synchronous_commit', 'off', true) AS synchronous_commit`,
	(txTimeout + commitTimeout).Milliseconds())

func (rb relayBeginner) ExecContext(ctx context.Context, query string, args ...any) (wsql.Result, error) {
	tag, err := rb.shard.relay.pool.Exec(ctx, query, args...)
	return wsql.PgxResult{CommandTag: tag}, err
}

func (rb relayBeginner) QueryContext(ctx context.Context, query string, args ...any) (wsql.Rows, error) {
	rows, err := rb.shard.relay.pool.Query(ctx, query, args...)
	return checkedRows{rows}, err
}

// relayTx is one relay transaction: the watermill-sql subscriber reads and
// acknowledges rows in it, and eventline settles the batch on commit. It
// costs two round trips: BEGIN (REPEATABLE READ: the position write then
// fails with a serialization error, instead of overwriting a newer
// position, if another relay moved it meanwhile) and the read, which also
// applies the transaction's settings (relaySettings), travel together, and
// so do the position write and COMMIT (commit).
type relayTx struct {
	conn   *pgxpool.Conn   // released when the transaction ends
	tx     pgx.Tx          // nil until the first statement began it
	ctx    context.Context // the transaction's: see relayBeginner.BeginTx
	cancel context.CancelFunc
	batch  *batch
	ended  bool // committed by commit
}

// begin sends BEGIN and query, with args, in one round trip, and returns
// the results with query's next.
func (t *relayTx) begin(query string, args []any) (pgx.BatchResults, error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	b.Queue(query, args...)
	br := t.conn.SendBatch(t.ctx, b)
	t.tx = br.Tx()
	if _, err := br.Exec(); err != nil { // BEGIN
		_ = br.Close()
		return nil, err
	}
	return br, nil
}

func (t *relayTx) ExecContext(_ context.Context, query string, args ...any) (wsql.Result, error) {
	if query == deferredAck {
		return wsql.PgxResult{}, nil // finish writes the position
	}
	if t.tx == nil {
		br, err := t.begin(query, args)
		if err != nil {
			return nil, err
		}
		tag, err := br.Exec()
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		return wsql.PgxResult{CommandTag: tag}, err
	}
	tag, err := t.tx.Exec(t.ctx, query, args...)
	return wsql.PgxResult{CommandTag: tag}, err
}

func (t *relayTx) QueryContext(_ context.Context, query string, args ...any) (wsql.Rows, error) {
	if t.tx == nil {
		br, err := t.begin(query, args)
		if err != nil {
			return nil, err
		}
		rows, err := br.Query()
		if err != nil {
			rows.Close()
			_ = br.Close()
			return nil, err
		}
		return batchRows{rows, br}, nil
	}
	rows, err := t.tx.Query(t.ctx, query, args...)
	return checkedRows{rows}, err
}

// commit records the position of the last finished row of done (none
// when it is empty) and clears the retry records of cleared, and commits, in
// one round trip. Nothing is sent when the transaction never began.
func (t *relayTx) commit(ctx context.Context, done []*item, cleared []string) error {
	if t.tx == nil {
		return nil
	}
	s := t.batch.shard
	b := &pgx.Batch{}
	if len(done) > 0 {
		// A row that is not finished (and everything after it) is read
		// again.
		last := done[len(done)-1]
		b.Queue(s.sql.recordOffset, last.offset, last.txID, outbox.RelayConsumerGroup)
	}
	if len(cleared) > 0 {
		b.Queue(s.sql.clearFailures, s.shard, cleared)
	}
	b.Queue("COMMIT")
	br := t.tx.SendBatch(ctx, b)
	var tag pgconn.CommandTag
	var err error
	for i := 0; i < b.Len() && err == nil; i++ {
		tag, err = br.Exec()
		switch {
		case err == nil, i == b.Len()-1:
		case len(done) > 0 && i == 0:
			err = fmt.Errorf("record position: %w", err)
		default:
			err = fmt.Errorf("clear relay failures: %w", err)
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil && tag.String() != "COMMIT" {
		err = pgx.ErrTxCommitRollback
	}
	t.ended = err == nil
	if t.ended {
		t.releaseConn()
	}
	return err
}

// rollback ends the transaction if it is still open, and gives its
// connection back. The transaction may be past its deadline.
func (t *relayTx) rollback() {
	if t.tx != nil && !t.ended && t.conn != nil && t.conn.Conn().PgConn().TxStatus() != 'I' {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = t.tx.Rollback(ctx)
	}
	t.releaseConn()
}

// Commit settles the batch, then commits or rolls back. It reports
// problems through the relay's logs and metrics and returns nil, since
// watermill-sql only logs commit errors: the next read starts from whatever
// position was recorded.
func (t *relayTx) Commit() error {
	defer t.release()
	t.batch.shard.finish(t)
	return nil
}

// Rollback waits for the batch's rows in flight, then rolls back; the
// rows are read again. Like Commit it returns nil: a rollback that fails
// means the connection is gone, and the transaction with it.
func (t *relayTx) Rollback() error {
	defer t.release()
	t.batch.wait(t.ctx)
	t.rollback()
	return nil
}

// release ends the transaction's context and gives its connection back,
// if commit or rollback has not already.
func (t *relayTx) release() {
	t.cancel()
	t.releaseConn()
}

// releaseConn returns the connection to the pool (which closes it instead
// if a transaction is still open on it) as soon as the transaction ended:
// what finish does after it (a retry record) takes a connection of its
// own.
func (t *relayTx) releaseConn() {
	if t.conn != nil {
		t.conn.Release()
		t.conn = nil
	}
}

// batchRows are the rows of a relay transaction's first query, read from
// the batch that began the transaction: closing them ends the batch, and
// reports a read that ended early like checkedRows.
type batchRows struct {
	pgx.Rows
	br pgx.BatchResults
}

func (r batchRows) Close() error {
	r.Rows.Close()
	err := r.Rows.Err()
	if cerr := r.br.Close(); err == nil {
		err = cerr
	}
	return err
}

// checkedRows reports a read that ended early (the connection broke) from
// Close: watermill-sql does not look at Err, and would otherwise commit the
// rows it got as if there were no more.
type checkedRows struct{ pgx.Rows }

func (r checkedRows) Close() error {
	r.Rows.Close()
	return r.Rows.Err()
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

// deferredAck is the "query" relayOffsetsAdapter gives watermill-sql for
// acknowledging a batch. relayTx recognizes it and sends nothing: the shard
// writes the position itself once Kafka has answered (finish).
const deferredAck = "-- eventline: the relay records the position after Kafka acknowledged the batch"

// relayOffsetsAdapter is watermill-sql's PostgreSQL offsets adapter with the
// two statements that would make a relay transaction hold a transaction id
// replaced:
//
//   - NextOffsetQuery fences concurrent readers of the shard with a
//     transaction-scoped advisory lock instead of SELECT … FOR UPDATE (a
//     row lock assigns a transaction id);
//   - AckMessageQuery is deferred to the end of the batch.
//
// PostgreSQL's xmin horizon counts every transaction holding an id, and the
// outbox is read only below it, so a relay transaction that held one while
// waiting for Kafka would hold back every other shard's newest rows. Now the
// id is taken by the final position write, just before commit. (Why the
// fence, and not the lease, keeps positions safe: relay_lease.go.)
type relayOffsetsAdapter struct {
	wsql.DefaultPostgreSQLOffsetsAdapter
	nextOffset string
	fenceNS    int64
	shard      int
}

// nextOffsetSQL reads the relays' position ($1 their consumer group) if
// the shard's read fence ($2 namespace, $3 shard) can be taken, and then
// applies the relay transaction's settings (relaySettings) in the same
// statement: watermill-sql materializes this query once per read (a CTE
// its select refers to three times), and the row it returns, the one case
// in which the transaction holds the fence and may write, computes them.
var nextOffsetSQL = `SELECT offset_acked, last_processed_transaction_id, ` + relaySettings + ` FROM {offsets}
	WHERE consumer_group = $1 AND pg_try_advisory_xact_lock($2::int, $3::int)`

func newRelayOffsetsAdapter(schema string, shard int) relayOffsetsAdapter {
	return relayOffsetsAdapter{
		DefaultPostgreSQLOffsetsAdapter: outbox.OffsetsAdapter(schema),
		nextOffset:                      outbox.SQL(schema, shard, nextOffsetSQL),
		fenceNS:                         outbox.FenceNamespace(schema),
		shard:                           shard,
	}
}

func (a relayOffsetsAdapter) NextOffsetQuery(params wsql.NextOffsetQueryParams) (wsql.Query, error) {
	return wsql.Query{
		Query: a.nextOffset,
		Args:  []any{params.ConsumerGroup, a.fenceNS, a.shard},
	}, nil
}

func (a relayOffsetsAdapter) AckMessageQuery(wsql.AckMessageQueryParams) (wsql.Query, error) {
	return wsql.Query{Query: deferredAck}, nil
}

// BeforeSubscribingQueries is empty: the shard writes the relay's zero
// position itself before it subscribes, under READ COMMITTED (see
// shardRunner.setUp for why not in a relay transaction).
func (a relayOffsetsAdapter) BeforeSubscribingQueries(wsql.BeforeSubscribingQueriesParams) ([]wsql.Query, error) {
	return nil, nil
}
