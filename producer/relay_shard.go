package producer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
)

const (
	// flushTimeout bounds how long a batch waits for Kafka's answers.
	flushTimeout = 2 * time.Minute
	// commitTimeout bounds the settling statements of one batch.
	commitTimeout = 30 * time.Second
	// queryRetryInterval is the pause after a failed outbox query.
	queryRetryInterval = time.Second
	// stallPollMin and stallPollMax bound the polling while committed rows
	// wait behind an older open transaction (the xmin horizon).
	stallPollMin   = 5 * time.Millisecond
	stallPollMax   = 500 * time.Millisecond
	stallFastPhase = 2 * time.Second
)

// shardRunner relays one outbox shard: a watermill-sql subscriber on the
// shard's table feeding a Watermill forwarder that publishes to Kafka. It
// also serves as the subscriber's BackoffManager, so every wait (idle,
// retry backoff) happens outside any transaction.
type shardRunner struct {
	relay *Relay
	shard int
	log   *slog.Logger
	sql   shardSQL

	stop chan struct{} // closed when the shard is released
	wake chan struct{} // an insert was notified
	done chan struct{} // closed when the forwarder returned

	fwd *forwarder.Forwarder

	// waiting is set while the shard's outbox_waiting row asks producers
	// to notify it. Only the subscriber's goroutine touches it.
	waiting bool

	mu           sync.Mutex
	failures     map[string]failureRecord // by outbox uuid
	backoffUntil time.Time
	stallDelay   time.Duration
	stallSince   time.Time
	stallWarned  bool
}

type shardSQL struct {
	recordOffset  string
	backlogExists string
	wait, unwait  string
	horizonPassed string
	snapshotXmax  string
}

func newShardSQL(schema string, shard int) shardSQL {
	messages := sqlident.Qualify(schema, outbox.Table(shard))
	offsets := sqlident.Qualify(schema, outbox.OffsetsTable(shard))
	waiting := sqlident.Qualify(schema, "outbox_waiting")
	return shardSQL{
		recordOffset: `INSERT INTO ` + offsets + ` (consumer_group, offset_acked, last_processed_transaction_id) VALUES ($3, $1, $2::text::xid8)
			ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = excluded.offset_acked, last_processed_transaction_id = excluded.last_processed_transaction_id`,
		wait: `INSERT INTO ` + waiting + ` (shard, expires_at) VALUES ($1, now() + make_interval(secs => $2))
			ON CONFLICT (shard) DO UPDATE SET expires_at = excluded.expires_at`,
		unwait:        `DELETE FROM ` + waiting + ` WHERE shard = $1`,
		snapshotXmax:  `SELECT pg_snapshot_xmax(pg_current_snapshot())::text`,
		horizonPassed: `SELECT pg_snapshot_xmin(pg_current_snapshot()) >= $1::text::xid8`,
		// Also keeps a waiting shard's request alive ($2, $3).
		backlogExists: `WITH keep AS (
				UPDATE ` + waiting + ` SET expires_at = now() + make_interval(secs => $3) WHERE shard = $2 AND $4
			)
			SELECT EXISTS (SELECT 1 FROM ` + messages + ` m, ` + offsets + ` o
			WHERE o.consumer_group = $1 AND (m.transaction_id, m."offset") > (o.last_processed_transaction_id, o.offset_acked))`,
	}
}

// startShard begins relaying shard; the caller holds its ownership lock.
func (r *Relay) startShard(ctx context.Context, shard int) (*shardRunner, error) {
	s := &shardRunner{
		relay: r,
		shard: shard,
		log:   r.log.With("shard", shard),
		sql:   newShardSQL(r.cfg.Schema, shard),
		stop:  make(chan struct{}),
		wake:  make(chan struct{}, 1),
		done:  make(chan struct{}),
	}
	failures, err := loadFailures(ctx, r.pool, r.cfg.Schema, shard)
	if err != nil {
		return nil, err
	}
	s.failures = failures

	ackDeadline := time.Minute
	sub, err := wsql.NewSubscriber(relayBeginner{pool: r.pool, shard: s}, wsql.SubscriberConfig{
		ConsumerGroup:  outbox.RelayConsumerGroup,
		AckDeadline:    &ackDeadline,
		ResendInterval: 10 * time.Millisecond,
		BackoffManager: s,
		SchemaAdapter:  relaySchemaAdapter{outbox.SchemaAdapter(r.cfg.Schema, r.cfg.BatchSize)},
		OffsetsAdapter: newRelayOffsetsAdapter(r.cfg.Schema, shard),
	}, r.wmLog)
	if err != nil {
		return nil, fmt.Errorf("shard %d: create outbox subscriber: %w", shard, err)
	}
	s.fwd, err = forwarder.NewForwarder(sub, shardPublisher{s}, r.wmLog, forwarder.Config{
		ForwarderTopic: outbox.Topic(shard),
		HandlerName:    fmt.Sprintf("eventline_relay_%s_%d", r.cfg.Schema, shard),
		Middlewares:    []message.HandlerMiddleware{s.guard},
		CloseTimeout:   flushTimeout + commitTimeout,
	})
	if err != nil {
		_ = sub.Close()
		return nil, fmt.Errorf("shard %d: create forwarder: %w", shard, err)
	}
	go func() {
		defer close(s.done)
		if err := s.fwd.Run(context.WithoutCancel(ctx)); err != nil {
			s.log.Error("relay forwarder stopped", "err", err)
		}
		_ = sub.Close()
	}()
	return s, nil
}

// close stops the shard after its current batch settles.
func (s *shardRunner) close() {
	close(s.stop)
	if err := s.fwd.Close(); err != nil {
		s.log.Warn("close relay forwarder", "err", err)
	}
	<-s.done
	s.unwait() // the subscriber has stopped: no one else touches waiting
}

func (s *shardRunner) notify() {
	select {
	case s.wake <- struct{}{}:
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
		if s.notDue(it.outboxUUID) {
			b.stopped.Store(true)
			return nil, nil
		}
		if lim := s.relay.limiter; lim != nil {
			if err := lim.Wait(msg.Context()); err != nil {
				b.stopped.Store(true)
				return nil, nil
			}
		}
		msg.SetContext(withItem(msg.Context(), it))
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

type itemKey struct{}

func withItem(ctx context.Context, it *item) context.Context {
	return context.WithValue(ctx, itemKey{}, it)
}

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
		b := it.b
		b.mu.Lock()
		it.event, it.topic = e, topic
		it.state, it.sent = itemInFlight, true
		b.mu.Unlock()
		if err := p.s.relay.sink.send(msg.Context(), topic, msg, it); err != nil {
			b.mu.Lock()
			it.state, it.sent = itemFailed, false
			b.mu.Unlock()
			return &publishError{err}
		}
	}
	return nil
}

func (p shardPublisher) Close() error { return nil }

// HandleError implements watermill-sql's BackoffManager. It is called after
// every read transaction ended, so waiting here holds no transaction; it
// returns 0 because it has already waited.
func (s *shardRunner) HandleError(_ watermillLogger, noMsg bool, err error) time.Duration {
	if err != nil {
		if s.stopping() || errors.Is(err, context.Canceled) {
			return 0
		}
		s.log.Warn("outbox read failed; retrying", "err", err)
		s.sleep(queryRetryInterval)
		return 0
	}
	if d := s.takeBackoff(); d > 0 {
		s.sleep(d)
		return 0
	}
	if !noMsg {
		s.unstall()
		s.unwait()
		return 0
	}
	s.idle()
	return 0
}

// idle waits for new rows, without holding a transaction.
//
// Producers notify a shard only while its relay says it is waiting (the
// outbox_waiting row), because a NOTIFY serializes their commits. So before
// it sleeps, the shard sets that row and then waits until every transaction
// that started before it has ended: one of them may have written a row
// without notifying. It then reads once more, and only then sleeps until a
// notification or PollInterval. A notification clears the row again, so
// busy shards cost producers nothing.
//
// If committed rows exist that the last read could not see, an older open
// transaction holds the xmin horizon: poll again shortly instead.
func (s *shardRunner) idle() {
	if !s.waiting {
		if err := s.announce(); err != nil {
			s.log.Warn("announce idle shard; polling instead", "err", err)
			s.sleepOrWake(s.relay.cfg.PollInterval)
			return
		}
		s.waiting = true
		return // read once more: see announce
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	var pending bool
	err := s.relay.pool.QueryRow(ctx, s.sql.backlogExists, outbox.RelayConsumerGroup, s.shard, s.waitTTL().Seconds(), s.waiting).Scan(&pending)
	cancel()
	if err == nil && pending {
		s.sleepOrWake(s.stall())
		return
	}
	s.unstall()
	if s.sleepOrWake(s.relay.cfg.PollInterval) {
		s.unwait()
	}
}

// announce marks the shard as waiting for notifications and returns once
// every transaction older than the mark has ended (or PollInterval passed,
// when an old transaction stays open: then PollInterval bounds the delay).
func (s *shardRunner) announce() error {
	ctx, cancel := context.WithTimeout(context.Background(), s.relay.cfg.PollInterval+5*time.Second)
	defer cancel()
	if _, err := s.relay.pool.Exec(ctx, s.sql.wait, s.shard, s.waitTTL().Seconds()); err != nil {
		return err
	}
	var xmax string
	if err := s.relay.pool.QueryRow(ctx, s.sql.snapshotXmax).Scan(&xmax); err != nil {
		return err
	}
	deadline := time.Now().Add(s.relay.cfg.PollInterval)
	for delay := time.Millisecond; time.Now().Before(deadline) && !s.stopping(); delay = min(2*delay, 50*time.Millisecond) {
		var passed bool
		if err := s.relay.pool.QueryRow(ctx, s.sql.horizonPassed, xmax).Scan(&passed); err != nil {
			return err
		}
		if passed {
			return nil
		}
		s.sleep(delay)
	}
	return nil
}

// waitTTL is how long a waiting mark lasts unless renewed: a few polls, so
// only a relay that died lets it lapse.
func (s *shardRunner) waitTTL() time.Duration {
	return max(3*s.relay.cfg.PollInterval, 10*time.Second)
}

// unwait clears the shard's waiting mark: it is busy again.
func (s *shardRunner) unwait() {
	if !s.waiting {
		return
	}
	s.waiting = false
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := s.relay.pool.Exec(ctx, s.sql.unwait, s.shard); err != nil {
		s.log.Debug("clear idle mark", "err", err)
	}
}

// stall returns how long to wait before reading a shard whose committed
// rows are held back by the xmin horizon: 5ms for the first 2s, since
// horizons held by ordinary short transactions pass quickly, then growing
// to 500ms, and it warns once the stall lasts 10s.
func (s *shardRunner) stall() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	if s.stallSince.IsZero() {
		s.stallSince = now
		s.relay.metrics.setStalled(s.shard, true)
	}
	stalled := now.Sub(s.stallSince)
	if stalled > 10*time.Second && !s.stallWarned {
		s.stallWarned = true
		s.log.Warn("relay stalled: committed events wait behind an older open transaction (xmin horizon); find it in pg_stat_activity", "stalled_for", stalled.Round(time.Second))
	}
	if stalled < stallFastPhase {
		return stallPollMin
	}
	s.stallDelay = min(max(2*s.stallDelay, stallPollMin), stallPollMax)
	return s.stallDelay
}

func (s *shardRunner) unstall() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.stallSince.IsZero() {
		s.relay.metrics.addStalled(s.shard, time.Since(s.stallSince))
		s.relay.metrics.setStalled(s.shard, false)
	}
	s.stallSince, s.stallDelay, s.stallWarned = time.Time{}, 0, false
}

// sleepOrWake waits for d, a notification or the shard's release, and
// reports whether a notification woke it.
func (s *shardRunner) sleepOrWake(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.wake:
		return true
	case <-s.stop:
	}
	return false
}

func (s *shardRunner) stopping() bool {
	select {
	case <-s.stop:
		return true
	default:
		return false
	}
}

func (s *shardRunner) sleep(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.stop:
	}
}

func (s *shardRunner) takeBackoff() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := time.Until(s.backoffUntil)
	s.backoffUntil = time.Time{}
	return max(d, 0)
}

// notDue reports whether a row's next retry is still in the future.
func (s *shardRunner) notDue(outboxUUID string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.failures[outboxUUID]
	if ok && time.Now().Before(rec.nextAttempt) {
		if rec.nextAttempt.After(s.backoffUntil) {
			s.backoffUntil = rec.nextAttempt
		}
		return true
	}
	return false
}
