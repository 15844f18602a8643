package producer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgerr"
)

const (
	// flushTimeout bounds how long a batch waits for Kafka's answers.
	flushTimeout = 2 * time.Minute
	// commitTimeout bounds the settling statements of one batch.
	commitTimeout = 30 * time.Second
	// txTimeout bounds a whole relay transaction, every statement in it
	// included: reading, waiting for Kafka, settling.
	txTimeout = flushTimeout + 2*commitTimeout
	// stopGrace is how long a stopping shard waits for Kafka to answer for
	// its batch in flight (so the position is recorded and nothing is sent
	// twice) before it abandons the batch; its statements are cancelled
	// then too. It bounds how long Relay.Run takes to return.
	stopGrace = 5 * time.Second
	// shutdownTimeout bounds Relay.Run's wait for its shards to stop.
	shutdownTimeout = stopGrace + 10*time.Second
	// setupTimeout bounds a shard's set-up statements.
	setupTimeout = 10 * time.Second
	// statementTimeout bounds the relay's short statements outside relay
	// transactions: polls, idle marks and checks.
	statementTimeout = 5 * time.Second
	// queryRetryInterval is the pause after a failed outbox query.
	queryRetryInterval = time.Second
)

// restartBackoff is the wait before each restart of a shard whose relaying
// stopped unexpectedly: 100ms, doubling, at most 30s; a run that lasted
// longer than Max starts the schedule again.
var restartBackoff = eventline.Backoff{Initial: 100 * time.Millisecond, Multiplier: 2, Max: 30 * time.Second}

// stopReason says why a shard runner stops.
type stopReason int32

const (
	stopNone     stopReason = iota
	stopReleased            // rebalancing gave the shard away
	stopShutdown            // Relay.Run is returning
	stopExpired             // the lease could not be renewed in time
	stopLost                // another relay holds the lease
)

func (r stopReason) String() string {
	return [...]string{"running", "released", "shutdown", "lease expired", "lease lost"}[r]
}

// shardRunner relays one outbox shard while this relay holds its lease: a
// watermill-sql subscriber on the shard's table feeding a Watermill
// forwarder that publishes to Kafka, restarted with backoff whenever it
// stops without being asked to. It also serves as the subscriber's
// BackoffManager, so every wait (idle, retry backoff) happens outside any
// transaction.
type shardRunner struct {
	relay *Relay
	shard int
	log   *slog.Logger
	sql   shardSQL

	// soft is cancelled when the shard is asked to stop: it publishes
	// nothing more and settles its batch. hard is cancelled stopGrace
	// later, or at once when the lease runs out: every statement of the
	// shard is cancelled and a batch still waiting for Kafka is abandoned.
	soft, hard             context.Context
	cancelSoft, cancelHard context.CancelFunc
	why                    atomic.Int32  // stopReason
	wake                   chan struct{} // an insert was notified
	done                   chan struct{} // closed when the runner ended

	leaseMu    sync.Mutex
	leaseTimer *time.Timer // stops the shard at its lease's local deadline
	// leaseUntil is the lease's local deadline, in monoNow's clock. The
	// timer stops the shard then; the publish path checks it too, since a
	// process resumed after being stopped (SIGSTOP, a VM pause) runs its
	// goroutines and its fired timers in no particular order.
	leaseUntil  atomic.Int64
	expiredOnce sync.Once

	// waiting is set while the shard's outbox_waiting row asks producers
	// to notify it. Only the subscriber's goroutine touches it.
	waiting bool

	// lastPositionCheck is when checkPosition last ran; only the
	// subscriber's goroutine touches it after set-up.
	lastPositionCheck time.Time

	// lastRows is when a read last found rows, lastBatch how many; only
	// the subscriber's goroutine touches them.
	lastRows  time.Time
	lastBatch int

	mu           sync.Mutex
	failures     map[string]failureRecord // by outbox uuid
	backoffUntil time.Time
	stallSince   time.Time
	stallWarned  bool
}

// shardSQL holds a shard's statements, rendered once for its tables.
type shardSQL struct {
	zeroOffsets   string
	recordOffset  string
	backlogExists string
	wait, unwait  string
	horizonPassed string
	snapshotXmax  string
	endFence      string
	recordFailure string
	clearFailures string
}

func newShardSQL(schema string, shard int) shardSQL {
	q := func(query string) string { return outbox.SQL(schema, shard, query) }
	return shardSQL{
		zeroOffsets: q(`INSERT INTO {offsets} (consumer_group, offset_acked, last_processed_transaction_id) VALUES ($1, 0, '0')
			ON CONFLICT DO NOTHING`),
		recordOffset: q(`INSERT INTO {offsets} (consumer_group, offset_acked, last_processed_transaction_id) VALUES ($3, $1, $2::text::xid8)
			ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = excluded.offset_acked, last_processed_transaction_id = excluded.last_processed_transaction_id`),
		wait: q(`INSERT INTO {schema}.outbox_waiting (shard, expires_at) VALUES ($1, now() + make_interval(secs => $2))
			ON CONFLICT (shard) DO UPDATE SET expires_at = excluded.expires_at`),
		unwait:        q(`DELETE FROM {schema}.outbox_waiting WHERE shard = $1`),
		snapshotXmax:  `SELECT pg_snapshot_xmax(pg_current_snapshot())::text`,
		horizonPassed: `SELECT pg_snapshot_xmin(pg_current_snapshot()) >= $1::text::xid8`,
		// Also keeps a waiting shard's request alive ($2, $3).
		backlogExists: q(`WITH keep AS (
				UPDATE {schema}.outbox_waiting SET expires_at = now() + make_interval(secs => $3) WHERE shard = $2 AND $4
			)
			SELECT EXISTS (SELECT 1 FROM {offsets} o CROSS JOIN LATERAL (
				SELECT 1 FROM {messages} m WHERE (m.transaction_id, m."offset") > (o.last_processed_transaction_id, o.offset_acked)
				ORDER BY m.transaction_id, m."offset" LIMIT 1) x
			WHERE o.consumer_group = $1)`),
		// Terminates the backends other than this one holding the shard's
		// read fence ($1 namespace, $2 shard), each with whether it ended
		// within a second: see clearFence. One statement, so that only a
		// backend seen holding the fence is signalled.
		endFence: `SELECT pid, pg_terminate_backend(pid, 1000) FROM pg_locks
			WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND pid <> pg_backend_pid()
			  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND classid::bigint = $1 AND objid::bigint = $2`,
		recordFailure: q(`INSERT INTO {schema}.relay_failures (shard, outbox_uuid, attempts, last_error, next_attempt_at) VALUES ($1, $2, $3, $4, $5)
			ON CONFLICT (shard, outbox_uuid) DO UPDATE SET
				attempts = excluded.attempts, last_error = excluded.last_error, next_attempt_at = excluded.next_attempt_at`),
		clearFailures: q(`DELETE FROM {schema}.relay_failures WHERE shard = $1 AND outbox_uuid = ANY($2)`),
	}
}

// startShard begins relaying shard, whose lease this relay holds until
// deadline (in its own clock).
func (r *Relay) startShard(shard int, deadline time.Time) {
	s := &shardRunner{
		relay: r,
		shard: shard,
		log:   r.log.With("shard", shard),
		sql:   newShardSQL(r.cfg.Schema, shard),
		wake:  make(chan struct{}, 1),
		done:  make(chan struct{}),
	}
	s.soft, s.cancelSoft = context.WithCancel(context.Background())
	s.hard, s.cancelHard = context.WithCancel(context.Background())
	s.leaseUntil.Store(monoAt(deadline))
	s.leaseTimer = time.AfterFunc(time.Until(deadline), s.leaseTimerFired)
	r.mu.Lock()
	r.running[shard] = s
	r.mu.Unlock()
	go s.supervise()
}

// supervise relays the shard until it is asked to stop. Whenever relaying
// ends on its own (its set-up failed, the forwarder stopped), it logs,
// counts eventline_relay_shard_restarts_total and starts again after a
// backoff, still holding the lease.
func (s *shardRunner) supervise() {
	defer func() {
		s.unwait()
		s.leaseMu.Lock()
		s.leaseTimer.Stop()
		s.leaseMu.Unlock()
		s.cancelSoft()
		s.cancelHard()
		close(s.done)
		signal(s.relay.exited)
	}()
	restarts := 0
	for {
		began := time.Now()
		err := s.runOnce()
		if s.stopping() {
			return
		}
		if time.Since(began) > restartBackoff.Max {
			restarts = 0
		}
		restarts++
		delay := backoff.Jittered(restartBackoff, restarts)
		s.relay.metrics.add(restartsCounter, s.shard, 1)
		if err == nil {
			err = errors.New("the forwarder stopped by itself")
		}
		s.log.Error("shard relaying stopped unexpectedly; restarting it", "err", err, "retry_in", delay)
		s.sleep(delay)
	}
}

// runOnce sets the shard up and runs its forwarder until the shard is
// asked to stop or the forwarder ends.
func (s *shardRunner) runOnce() error {
	r := s.relay
	if err := s.setUp(); err != nil {
		return err
	}
	ackDeadline := time.Minute
	sub, err := wsql.NewSubscriber(relayBeginner{s}, wsql.SubscriberConfig{
		ConsumerGroup:  outbox.RelayConsumerGroup,
		AckDeadline:    &ackDeadline,
		ResendInterval: 10 * time.Millisecond,
		BackoffManager: s,
		SchemaAdapter:  relaySchemaAdapter{outbox.SchemaAdapter(r.cfg.Schema, r.cfg.BatchSize)},
		OffsetsAdapter: newRelayOffsetsAdapter(r.cfg.Schema, s.shard),
	}, r.wmLog)
	if err != nil {
		return fmt.Errorf("create outbox subscriber: %w", err)
	}
	defer func() { _ = sub.Close() }()
	fwd, err := forwarder.NewForwarder(sub, shardPublisher{s}, r.wmLog, forwarder.Config{
		ForwarderTopic: outbox.Topic(s.shard),
		HandlerName:    fmt.Sprintf("eventline_relay_%s_%d", r.cfg.Schema, s.shard),
		Middlewares:    []message.HandlerMiddleware{s.guard},
		// Every statement and Kafka wait of the shard ends stopGrace after
		// the stop request; this only bounds what is left.
		CloseTimeout: stopGrace + setupTimeout,
	})
	if err != nil {
		return fmt.Errorf("create forwarder: %w", err)
	}
	ran := make(chan struct{})
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		select {
		case <-s.soft.Done():
		case <-ran:
			return
		}
		// Close a router only once it runs: after a failed start its
		// handler never runs, and Close would wait CloseTimeout for it.
		select {
		case <-fwd.Running():
			if err := fwd.Close(); err != nil {
				s.log.Warn("close relay forwarder", "err", err)
			}
		case <-ran:
		}
	}()
	err = fwd.Run(context.Background())
	close(ran)
	<-closed
	return err
}

// setUp prepares the shard for reading: a stale read fence released, the
// relay's zero position (under READ COMMITTED: the old owner may be moving
// that row right now, and under REPEATABLE READ the insert would fail with
// a serialization error), and the retry state loaded.
func (s *shardRunner) setUp() error {
	r := s.relay
	ctx, cancel := context.WithTimeout(s.soft, setupTimeout)
	defer cancel()
	// First: a vanished owner's transaction may hold the position row's
	// lock, which the insert below would wait for.
	s.clearFence(ctx)
	err := pgx.BeginTxFunc(ctx, r.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, s.sql.zeroOffsets, outbox.RelayConsumerGroup)
		return err
	})
	if err != nil {
		return fmt.Errorf("set up relay position: %w", err)
	}
	s.checkPosition(ctx)
	failures, err := loadFailures(ctx, r.pool, r.cfg.Schema, s.shard)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.failures = failures
	s.mu.Unlock()
	return nil
}

// clearFence ends a transaction that still holds the shard's read fence
// although this relay holds the lease. The previous owner stopped relaying
// before its lease expired, so such a transaction belongs to a relay whose
// host vanished or froze mid-batch; PostgreSQL would keep it until TCP
// gives up or its idle_in_transaction_session_timeout (txTimeout) passes.
// Terminating it rolls back its batch, which this relay then re-sends.
// It needs the right to signal that backend (same role, or
// pg_signal_backend); without it the shard waits for the timeout.
//
// One statement finds the holders and terminates them: the old owner may
// still be alive (a takeover while it runs) and commit at any moment,
// releasing the fence and returning its connection to a pool, where other
// work (the application's, when the relay shares its pool) runs on the same
// backend. Looking the holders up and terminating them in two round trips
// would kill that unrelated session; in one, a backend is signalled only
// when the statement's own read of pg_locks shows it holding the fence, and
// another query can only begin on it after a round trip to its client.
func (s *shardRunner) clearFence(ctx context.Context) {
	type ended struct {
		Pid int32
		OK  bool
	}
	const cannotEnd = "a previous owner's transaction still holds the shard and could not be ended; the shard waits until PostgreSQL ends it"
	// A failed Query reports its error through CollectRows too.
	rows, _ := s.relay.pool.Query(ctx, s.sql.endFence, outbox.FenceNamespace(s.relay.cfg.Schema), s.shard)
	holders, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ended])
	switch {
	case pgerr.HasCode(err, "42501"): // insufficient_privilege: may not signal it
		s.log.Warn(cannotEnd, "wait_at_most", txTimeout, "err", err)
	case err != nil:
		s.log.Warn("look for a stale read fence", "err", err)
	}
	for _, h := range holders {
		if !h.OK {
			s.log.Warn(cannotEnd, "pid", h.Pid, "wait_at_most", txTimeout)
			continue
		}
		s.relay.metrics.add(fencesClearedCounter, s.shard, 1)
		s.log.Warn("ended a previous owner's stale transaction on the shard (its relay vanished mid-batch)", "pid", h.Pid)
	}
}

// checkPosition warns loudly when the shard's position or rows carry
// transaction ids this cluster has not handed out: the outbox was moved
// from another cluster, and nothing will be relayed until an operator runs
// `eventline relay rebase-positions`.
func (s *shardRunner) checkPosition(ctx context.Context) {
	s.lastPositionCheck = time.Now()
	c, err := outbox.CheckPosition(ctx, s.relay.pool, s.relay.cfg.Schema, s.shard)
	if err != nil {
		return
	}
	s.relay.metrics.set(positionAheadFlag, s.shard, c.Ahead())
	if c.Ahead() {
		s.log.Error("nothing on this shard can be relayed: "+outbox.ErrPositionAhead.Error()+"; stop the relays and run `eventline relay rebase-positions` (see the README, \"Moving the database\")",
			"position_xid", c.Position, "newest_row_xid", c.NewestRow, "cluster_next_xid", c.Counter)
	}
}

// halt asks the shard to stop for reason: it publishes nothing more and
// settles its batch. Its statements and its wait for Kafka are cut short
// stopGrace later; when its lease expired, one RebalanceInterval later
// (before PostgreSQL's lease expires); when another relay holds the lease,
// at once.
func (s *shardRunner) halt(reason stopReason) {
	first := s.why.CompareAndSwap(int32(stopNone), int32(reason))
	if first {
		s.cancelSoft()
	}
	switch {
	case reason == stopLost:
		s.cancelHard()
	case reason == stopExpired:
		time.AfterFunc(s.relay.cfg.RebalanceInterval, s.cancelHard)
	case first:
		time.AfterFunc(stopGrace, s.cancelHard)
	}
}

func (s *shardRunner) reason() stopReason { return stopReason(s.why.Load()) }

// extend moves the lease's local deadline after a renewal. A lease that
// already ran out locally stays out: the shard is stopping.
func (s *shardRunner) extend(deadline time.Time) {
	s.leaseMu.Lock()
	defer s.leaseMu.Unlock()
	if s.leaseTimer.Stop() {
		s.leaseUntil.Store(monoAt(deadline))
		s.leaseTimer.Reset(time.Until(deadline))
	}
}

// leaseTimerFired runs when the lease's local deadline passes unrenewed.
func (s *shardRunner) leaseTimerFired() {
	if hook := leaseTimerHook.Load(); hook != nil {
		(*hook)(s.relay.cfg.Schema, s.shard)
	}
	s.leaseExpired()
}

// leaseTimerHook, when set (by tests), runs when a shard's lease timer
// fires, before the shard is stopped: holding it stands for a process
// resumed after a pause whose fired timers have not run yet.
var leaseTimerHook atomic.Pointer[func(schema string, shard int)]

// leaseExpired stops the shard once the lease's local deadline passed
// unrenewed: called by its timer, or by the publish path finding the
// deadline passed first.
func (s *shardRunner) leaseExpired() {
	s.expiredOnce.Do(func() {
		if !s.ended() {
			s.log.Warn("shard lease could not be renewed in time; stopping the shard before another relay may take it")
			s.relay.metrics.add(leaseExpiredCounter, s.shard, 1)
		}
	})
	s.halt(stopExpired)
}

// mayPublish is checked right before each record is handed to Kafka: the
// shard is not stopping and its lease's local deadline has not passed, by
// the monotonic clock. It stops the shard when the deadline has passed.
func (s *shardRunner) mayPublish() bool {
	if s.stopping() {
		return false
	}
	if monoNow() >= s.leaseUntil.Load() {
		s.leaseExpired()
		return false
	}
	return true
}

// monoStart anchors monoNow: readings taken from it use Go's monotonic
// clock, which never jumps with the wall clock and keeps counting while
// the process is stopped.
var monoStart = time.Now()

// monoNow is the time since monoStart, in nanoseconds.
func monoNow() int64 { return int64(time.Since(monoStart)) }

// monoAt is t (a time.Now reading, or one derived from it) in monoNow's
// clock.
func monoAt(t time.Time) int64 { return int64(t.Sub(monoStart)) }

func (s *shardRunner) ended() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

func (s *shardRunner) notify() { signal(s.wake) }

// signal sends on ch, a channel of capacity one, unless a signal is
// already pending there.
func signal(ch chan<- struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// guard is the forwarder's middleware. It registers each outbox row with
// its transaction's batch and decides whether to publish it now. It always
// acknowledges to the subscriber: which rows count as done is settled when
// the transaction commits (finish), so a wait never holds a transaction.
func (s *shardRunner) guard(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		wtx, _ := wsql.TxFromContext(msg.Context())
		rtx, ok := wtx.(*relayTx)
		if !ok {
			return nil, errors.New("eventline: outbox message outside a relay transaction")
		}
		b := rtx.batch
		it := b.register(msg)
		if it == nil {
			return nil, nil // the transaction already settled without this row
		}
		defer b.settle(it)
		if b.dead(it) || b.stopped.Load() {
			return nil, nil
		}
		if s.stopping() {
			// Released or shutting down: publish nothing more; the next
			// owner reads these rows again.
			b.stopped.Store(true)
			return nil, nil
		}
		// A row whose retry is not due, or the rate limit's wait cut
		// short, stops the batch too.
		due, alone := s.retryDue(it.outboxUUID)
		if lim := s.relay.limiter; !due || lim != nil && lim.Wait(msg.Context()) != nil {
			b.stopped.Store(true)
			return nil, nil
		}
		if alone {
			// Kafka refused the batch this row was in as too large: it
			// goes alone, the rows after it in the next transaction.
			it.alone = true
			b.stopped.Store(true)
		}
		msg.SetContext(context.WithValue(msg.Context(), itemKey{}, it))
		_, err := h(msg)
		if err == nil {
			return nil, nil
		}
		var pe *publishError
		if !errors.As(err, &pe) {
			// The forwarder could not unwrap the envelope: nothing to publish.
			b.set(it, itemDead, err, "malformed outbox envelope: "+err.Error())
			return nil, nil
		}
		b.set(it, itemFailed, pe.err, "")
		if !isPermanent(pe.err) {
			b.stopped.Store(true)
		}
		return nil, nil
	}
}

// itemKey carries a message's *item from guard to shardPublisher.
type itemKey struct{}

// publishError marks errors from shardPublisher, as opposed to the
// forwarder failing to unwrap an envelope.
type publishError struct{ err error }

func (e *publishError) Error() string { return e.err.Error() }
func (e *publishError) Unwrap() error { return e.err }

// shardPublisher is the forwarder's output: it checks each unwrapped event
// and hands it to the relay's Kafka sink.
type shardPublisher struct{ s *shardRunner }

func (p shardPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		it, _ := msg.Context().Value(itemKey{}).(*item)
		if it == nil {
			return &publishError{errors.New("eventline: message outside a relay batch")}
		}
		e, err := eventline.Decode(msg)
		if err != nil {
			return &publishError{&permanentError{err}}
		}
		if err := eventline.ValidateTopic(topic); err != nil {
			return &publishError{&permanentError{err}}
		}
		if hook := beforeSendHook.Load(); hook != nil {
			(*hook)(p.s.relay.cfg.Schema, p.s.shard, e.ID)
		}
		if !p.s.mayPublish() {
			// The lease ran out (or the shard was asked to stop) since the
			// guard looked: another relay may relay this row now.
			return &publishError{errNotSent}
		}
		if tr := p.s.relay.tracer; tr != nil {
			// The send span continues the trace PublishTx captured in the
			// row; the record carries the send span's context instead.
			_, it.span = tr.StartSend(tr.Extract(msg.Context(), msg.Metadata), topic, e, p.s.shard)
			tr.Inject(trace.ContextWithSpan(msg.Context(), it.span), msg.Metadata)
		}
		b := it.b
		b.mu.Lock()
		it.event, it.topic = e, topic
		it.state, it.sent = itemInFlight, true
		b.mu.Unlock()
		if err := p.s.relay.sink.send(msg.Context(), topic, msg, it); err != nil {
			b.mu.Lock()
			it.state, it.sent = itemFailed, false
			b.mu.Unlock()
			it.endSpan(0, 0, err)
			return &publishError{err}
		}
	}
	return nil
}

func (p shardPublisher) Close() error { return nil }

// beforeSendHook, when set (by tests), runs in shardPublisher.Publish
// before the lease check that precedes each send.
var beforeSendHook atomic.Pointer[func(schema string, shard int, eventID string)]
