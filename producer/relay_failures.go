package producer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/eapache/go-resiliency/breaker"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/sqlident"
)

var errFlushTimeout = errors.New("eventline: no answer from Kafka within the flush timeout")

// errShardStopped marks rows abandoned because their shard stopped (its
// stop grace ran out, or its lease was lost) before Kafka answered.
var errShardStopped = errors.New("eventline: the shard stopped before Kafka answered")

// errNotSent marks a row not handed to Kafka because its shard's lease ran
// out, or the shard was asked to stop, just before.
var errNotSent = errors.New("eventline: not sent: the shard's lease ran out, or the shard is stopping")

// permanentError marks a publish failure that retrying cannot fix.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// failureKind says how the relay treats a publish failure.
type failureKind int

const (
	// failRetry: retry with backoff, dead-letter after MaxAttempts.
	failRetry failureKind = iota
	// failPermanent: the message itself is rejected; dead-letter now.
	failPermanent
	// failUnavailable: Kafka cannot be reached, or Sarama's circuit
	// breaker stopped trying for a while; retry with backoff forever, and
	// do not count it as an attempt of the message.
	failUnavailable
	// failBatchTooLarge: Kafka refused, as too large for the topic, the
	// record batch this record was sent in with others (Sarama batches up
	// to RelayConfig.MaxMessageBytes; a topic's max.message.bytes may be
	// smaller). Not the record's fault yet: sent again at once, alone, not
	// counted; refused alone, it is (failPermanent).
	failBatchTooLarge
)

func classify(err error) failureKind {
	var pe *permanentError
	if errors.As(err, &pe) {
		return failPermanent
	}
	var cfgErr sarama.ConfigurationError
	if errors.As(err, &cfgErr) {
		// Sarama's own checks on one record, e.g. larger than
		// Producer.MaxMessageBytes.
		return failPermanent
	}
	var kerr sarama.KError
	if errors.As(err, &kerr) {
		switch kerr {
		case sarama.ErrMessageSizeTooLarge, sarama.ErrInvalidMessage, sarama.ErrInvalidTopic,
			sarama.ErrTopicAuthorizationFailed, sarama.ErrInvalidTimestamp, sarama.ErrInvalidRecord,
			sarama.ErrPolicyViolation:
			return failPermanent
		case sarama.ErrLeaderNotAvailable, sarama.ErrNotLeaderForPartition, sarama.ErrRequestTimedOut,
			sarama.ErrBrokerNotAvailable, sarama.ErrReplicaNotAvailable, sarama.ErrNetworkException,
			sarama.ErrNotEnoughReplicas, sarama.ErrNotEnoughReplicasAfterAppend,
			sarama.ErrKafkaStorageError, sarama.ErrNotController,
			// The idempotent producer's sequence state went out of step with
			// the broker after earlier failures; Sarama bumps its epoch and
			// the next attempt goes through. Not the message's fault.
			sarama.ErrOutOfOrderSequenceNumber, sarama.ErrDuplicateSequenceNumber,
			sarama.ErrInvalidProducerEpoch, sarama.ErrUnknownProducerID, sarama.ErrProducerFenced:
			return failUnavailable
		}
		return failRetry
	}
	var netErr net.Error
	switch {
	// io.EOF: the broker (or a proxy or load balancer in front of it)
	// closed the connection, accepting it and closing it at once when it
	// is going away; Sarama returns the bare EOF once its retries are
	// spent. Counted as the message's attempts, it dead-lettered events
	// during an outage (TestKafkaOutageDoesNotStretchTheRetryWait against
	// a fault proxy).
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, breaker.ErrBreakerOpen), errors.Is(err, sarama.ErrOutOfBrokers), errors.Is(err, sarama.ErrNotConnected),
		errors.Is(err, sarama.ErrClosedClient), errors.Is(err, sarama.ErrShuttingDown),
		errors.Is(err, errSinkClosed), errors.Is(err, errFlushTimeout), errors.Is(err, errShardStopped), errors.Is(err, errNotSent),
		errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded),
		errors.As(err, &netErr):
		return failUnavailable
	}
	return failRetry
}

func isPermanent(err error) bool { return classify(err) == failPermanent }

// classifyItem is classify for a row's failure, told whether the row was
// published alone: a record Kafka refuses as too large is at fault only
// if nothing was batched with it.
func classifyItem(it *item) failureKind {
	kind := classify(it.err)
	if kind == failPermanent && !it.alone && refusedTooLarge(it.err) {
		return failBatchTooLarge
	}
	return kind
}

// refusedTooLarge reports whether Kafka refused a record (or its batch) as
// too large, as opposed to Sarama's own size check before any batch.
func refusedTooLarge(err error) bool {
	var cfgErr sarama.ConfigurationError
	return errors.Is(err, sarama.ErrMessageSizeTooLarge) && !errors.As(err, &cfgErr)
}

// topicLimit is a topic's max.message.bytes as a broker described it.
type topicLimit struct {
	bytes int // 0: unknown
	at    time.Time
}

// topicLimitMemory is how long a described max.message.bytes is trusted.
const topicLimitMemory = time.Minute

// recordTooLargeError is Kafka's refusal of a record as too large
// (MESSAGE_TOO_LARGE) with what the relay knows of both limits. It
// unwraps to Kafka's error, so it is classified like it.
type recordTooLargeError struct {
	topic       string
	recordBytes int // Sarama's estimate of the record alone
	topicLimit  int // the topic's max.message.bytes; 0 if unknown
	relayLimit  int // RelayConfig.MaxMessageBytes
	err         error
}

func (e *recordTooLargeError) Error() string {
	topic := "its max.message.bytes (unknown: describing the topic failed; or the brokers' message.max.bytes)"
	if e.topicLimit > 0 {
		topic = fmt.Sprintf("its max.message.bytes, %d bytes,", e.topicLimit)
	}
	return fmt.Sprintf("Kafka refused a record of about %d bytes as too large for topic %q: %s is below RelayConfig.MaxMessageBytes (%d bytes), "+
		"which sizes the relay's records and batches; raise the topic's max.message.bytes to at least RelayConfig.MaxMessageBytes "+
		"(and producer.Config.MaxMessageBytes to match), or lower both to the topic's: %v",
		e.recordBytes, e.topic, topic, e.relayLimit, e.err)
}

func (e *recordTooLargeError) Unwrap() error { return e.err }

// explainTooLarge returns err, as a *recordTooLargeError naming both limits
// when Kafka refused msg as too large.
func (s *kafkaSink) explainTooLarge(msg *sarama.ProducerMessage, err error) error {
	if !refusedTooLarge(err) {
		return err
	}
	return &recordTooLargeError{topic: msg.Topic, recordBytes: msg.ByteSize(2), topicLimit: s.topicLimit(msg.Topic),
		relayLimit: s.cfg.Producer.MaxMessageBytes, err: err}
}

// topicLimit returns topic's max.message.bytes as the brokers describe it
// (cached for topicLimitMemory), or 0 when they cannot say.
func (s *kafkaSink) topicLimit(topic string) int {
	s.limitsMu.Lock()
	defer s.limitsMu.Unlock()
	if l, ok := s.limits[topic]; ok && time.Since(l.at) < topicLimitMemory {
		return l.bytes
	}
	l := topicLimit{at: time.Now()}
	if admin, err := sarama.NewClusterAdmin(s.brokers, s.cfg); err == nil {
		entries, err := admin.DescribeConfig(sarama.ConfigResource{Type: sarama.TopicResource, Name: topic, ConfigNames: []string{"max.message.bytes"}})
		for _, e := range entries {
			if err == nil && e.Name == "max.message.bytes" {
				l.bytes, _ = strconv.Atoi(e.Value)
			}
		}
		_ = admin.Close()
	}
	if s.limits == nil {
		s.limits = map[string]topicLimit{}
	}
	s.limits[topic] = l
	return l.bytes
}

// maxUnavailableWait caps the wait before retrying a message while Kafka is
// unreachable, as it caps the waits between connection attempts: a shard
// resumes within 5 s of Kafka's return, however long the outage, as a
// consumer does (middleware.DefaultInfraBackoff.Max).
const maxUnavailableWait = 5 * time.Second

// unavailableBackoff is the schedule of waits while Kafka is unreachable,
// derived from the relay's Backoff: its first wait, doubling, at most
// maxUnavailableWait.
func unavailableBackoff(b eventline.Backoff) eventline.Backoff {
	return eventline.Backoff{Initial: min(b.Initial, maxUnavailableWait), Multiplier: 2, Max: maxUnavailableWait, Jitter: b.Jitter}
}

// failureRecord is the retry state of one outbox row.
type failureRecord struct {
	// attempts counts the failures that count towards MaxAttempts: those
	// specific to the message, not Kafka being unreachable.
	attempts int
	// failures counts every failure in a row; it grows the wait while
	// Kafka is unreachable (unavailableBackoff).
	failures    int
	nextAttempt time.Time
	// alone: the row is to be published alone in its next transaction
	// (failBatchTooLarge).
	alone bool
}

func loadFailures(ctx context.Context, pool *pgxpool.Pool, schema string, shard int) (map[string]failureRecord, error) {
	rows, err := pool.Query(ctx, sqlident.SQL(schema, `SELECT outbox_uuid, attempts, next_attempt_at FROM {schema}.relay_failures WHERE shard = $1`), shard)
	if err != nil {
		return nil, fmt.Errorf("shard %d: load relay failures: %w", shard, err)
	}
	out := map[string]failureRecord{}
	for rows.Next() {
		var id string
		var rec failureRecord
		if err := rows.Scan(&id, &rec.attempts, &rec.nextAttempt); err != nil {
			return nil, err
		}
		rec.failures = rec.attempts
		out[id] = rec
	}
	return out, rows.Err()
}

// settlePlan is what a finished batch records.
type settlePlan struct {
	done      []*item  // the prefix of the batch that is finished
	first     *item    // the first row that is not, or nil
	dead      []*item  // rows of done to dead-letter
	cleared   []string // outbox uuids whose retry records are obsolete
	delivered []string // event ids Kafka acknowledged
}

// plan walks the batch in outbox order. A row is done when Kafka has it or
// it is to be dead-lettered; the batch's progress stops before the first
// row that is neither, so it is read again.
func (s *shardRunner) plan(items []*item) settlePlan {
	s.mu.Lock()
	defer s.mu.Unlock()
	var p settlePlan
	for _, it := range items {
		_, hadFailed := s.failures[it.outboxUUID]
		switch it.state {
		case itemDelivered:
			p.delivered = append(p.delivered, it.event.ID)
		case itemDead:
		case itemFailed:
			attempts := s.failures[it.outboxUUID].attempts + 1
			switch kind := classifyItem(it); {
			case kind == failPermanent:
				it.state, it.deadReason, it.deadCause = itemDead, "rejected: "+it.err.Error(), held.CauseRejected
			case kind == failRetry && attempts >= s.relay.cfg.MaxAttempts:
				it.state, it.deadReason, it.deadCause = itemDead, fmt.Sprintf("gave up after %d attempts: %v", attempts, it.err), held.CauseRetriesExhausted
			default:
				p.first = it
				return p
			}
		default:
			p.first = it
			return p
		}
		if it.state == itemDead {
			p.dead = append(p.dead, it)
		}
		if hadFailed {
			p.cleared = append(p.cleared, it.outboxUUID)
		}
		p.done = append(p.done, it)
	}
	return p
}

// finish settles a relay transaction once Kafka answered for its rows: it
// records progress up to the last finished row, writes dead letters in the
// same transaction, and schedules the retry of the first unfinished row.
func (s *shardRunner) finish(t *relayTx) {
	b := t.batch
	b.wait(t.ctx)
	ctx, cancel := context.WithTimeout(t.ctx, commitTimeout)
	defer cancel()

	b.mu.Lock()
	p := s.plan(b.items)
	s.lastBatch = len(b.items)
	b.mu.Unlock()

	if t.ctx.Err() != nil {
		// The lease is lost or the stop grace ran out: writing now could
		// only fail. The next owner reads these rows again.
		s.abandoned(t, p, "the shard stopped before its batch settled")
		return
	}
	if hook := s.relay.cfg.AfterPublish; hook != nil && len(p.delivered) > 0 {
		if err := hook(s.shard, p.delivered); err != nil {
			wait := backoff.Jittered(s.relay.cfg.Backoff, 1)
			s.log.Warn("AfterPublish refused the batch; it will be published again", "events", len(p.delivered), "retry_in", wait, "err", err)
			t.rollback()
			s.setBackoff(wait)
			return
		}
	}
	if err := s.record(ctx, t, p); err != nil {
		if t.ctx.Err() != nil {
			s.abandoned(t, p, "the shard stopped while recording its batch")
			return
		}
		t.rollback()
		s.log.Error("record relay progress; the batch will be published again", "events", len(p.delivered), "err", err)
		s.setBackoff(queryRetryInterval)
		return
	}
	s.mu.Lock()
	for _, id := range p.cleared {
		delete(s.failures, id)
	}
	s.mu.Unlock()
	if n := len(p.delivered); n > 0 {
		s.relay.metrics.add(forwardedCounter, s.shard, float64(n))
	}
	for _, it := range p.dead {
		s.relay.metrics.add(deadLettersCounter, s.shard, 1)
		s.log.Warn("event dead-lettered", "event_id", it.event.ID, "outbox_uuid", it.outboxUUID, "reason", it.deadReason)
	}
	if p.first != nil && p.first.state == itemFailed && !errors.Is(p.first.err, errShardStopped) && !errors.Is(p.first.err, errNotSent) {
		s.recordFailure(ctx, p.first)
	}
}

// abandoned rolls back a batch the shard could not record because it is
// stopping without its lease or past its grace.
func (s *shardRunner) abandoned(t *relayTx, p settlePlan, why string) {
	t.rollback()
	if len(p.delivered) > 0 {
		s.log.Warn(why+"; its events will be published again", "events", len(p.delivered), "stop", s.reason().String())
	}
}

// record writes the plan in t and commits it: dead letters first, then the
// position, cleared retries and COMMIT in one round trip (relayTx.commit).
func (s *shardRunner) record(ctx context.Context, t *relayTx, p settlePlan) error {
	for _, it := range p.dead {
		if err := s.insertDeadLetter(ctx, t.tx, it); err != nil {
			return err
		}
	}
	return t.commit(ctx, p.done, p.cleared)
}

func (s *shardRunner) insertDeadLetter(ctx context.Context, tx pgx.Tx, it *item) error {
	e, topic := it.event, it.topic
	if e.ID == "" {
		e, topic = peekEnvelope(it.payload)
	}
	s.mu.Lock()
	attempts := s.failures[it.outboxUUID].attempts
	s.mu.Unlock()
	if it.err != nil && classify(it.err) != failUnavailable {
		attempts++
	}
	cause := it.deadCause
	if cause == "" {
		cause = held.CauseMalformed
	}
	lastErr := it.deadReason
	if it.err != nil {
		lastErr = it.err.Error()
	}
	return s.relay.held.AddRelay(ctx, tx, held.Event{
		Cause: cause, Reason: it.deadReason, Shard: s.shard, MessageUUID: it.outboxUUID,
		EventID: e.ID, EventType: e.Type, AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.AggregateVersion,
		Topic: topic, Payload: it.payload, Metadata: it.storedMetadata(), Attempts: attempts, LastError: lastErr,
	})
}

// recordFailure counts a failed attempt of the row the shard now waits on
// and schedules its retry.
func (s *shardRunner) recordFailure(ctx context.Context, it *item) {
	kind := classifyItem(it)
	s.mu.Lock()
	rec := s.failures[it.outboxUUID]
	rec.failures++
	if kind == failRetry {
		rec.attempts++
	}
	rec.alone = kind == failBatchTooLarge
	// A failure of the message walks Backoff by its counted attempts;
	// Kafka being away says nothing about the message (maxUnavailableWait).
	wait := backoff.Jittered(s.relay.cfg.Backoff, rec.attempts)
	switch kind {
	case failUnavailable:
		wait = backoff.Jittered(unavailableBackoff(s.relay.cfg.Backoff), rec.failures)
	case failBatchTooLarge:
		wait = 0 // at once, alone
	}
	if errors.Is(it.err, breaker.ErrBreakerOpen) {
		// Sarama's breaker stays open for 10s; retrying sooner only
		// meets it again.
		wait = max(wait, time.Second)
	}
	rec.nextAttempt = time.Now().Add(wait)
	s.failures[it.outboxUUID] = rec
	s.backoffUntil = rec.nextAttempt
	s.mu.Unlock()

	s.relay.metrics.add(retriesCounter, s.shard, 1)
	s.log.Warn("publish failed; the shard waits and retries", "event_id", it.event.ID, "topic", it.topic,
		"attempts", rec.attempts, "failures", rec.failures, "retry_in", wait, "err", it.err)
	_, err := s.relay.pool.Exec(ctx, s.sql.recordFailure,
		s.shard, it.outboxUUID, rec.attempts, it.err.Error(), rec.nextAttempt)
	if err != nil {
		s.log.Warn("persist relay failure", "err", err)
	}
}

func (s *shardRunner) setBackoff(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if until := time.Now().Add(d); until.After(s.backoffUntil) {
		s.backoffUntil = until
	}
}

// peekEnvelope reads what it can from a forwarder envelope that failed to
// unwrap or decode, for the dead letter's columns.
func peekEnvelope(payload []byte) (eventline.Event, string) {
	var env forwarderEnvelope
	_ = json.Unmarshal(payload, &env) // fills what it can
	e := eventline.Event{
		ID:            env.Metadata[eventline.MetaEventID],
		Type:          env.Metadata[eventline.MetaEventType],
		AggregateType: env.Metadata[eventline.MetaAggregateType],
		AggregateID:   env.Metadata[eventline.MetaAggregateID],
	}
	_, _ = fmt.Sscan(env.Metadata[eventline.MetaAggregateVersion], &e.AggregateVersion)
	return e, env.DestinationTopic
}

// storedMetadata is the row's metadata column for its dead letter: a
// column that was not a JSON object of strings is kept whole under
// metaRawMetadata (a replay re-enqueues the row without it).
func (it *item) storedMetadata() map[string]string {
	if it.rawMeta != nil {
		return map[string]string{metaRawMetadata: string(it.rawMeta)}
	}
	return it.metadata
}
