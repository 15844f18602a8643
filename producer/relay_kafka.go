package producer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/eapache/go-resiliency/breaker"

	"github.com/eventline/eventline"
)

// errSinkClosed is returned by send after close started.
var errSinkClosed = errors.New("eventline: relay Kafka producer is closed")

// kafkaSink publishes to Kafka through one Sarama async producer shared by
// every shard of a relay. Records are built by watermill-kafka's marshaler
// keyed by aggregate id, so consumers read them with a plain watermill-kafka
// subscriber and one aggregate always lands in one partition.
//
// send returns as soon as the record is queued; its outcome is reported to
// the record's batch, which the shard waits for before acknowledging the
// outbox rows. Many records are thus in flight per Kafka round trip, while
// the idempotent producer (one request in flight per broker) keeps each
// partition in send order as long as sends succeed. A record whose send
// failed (Kafka unreachable) is sent again after the records behind it may
// have been written: Kafka then holds its aggregate's versions out of
// order, which the consumers' version gate puts right (docs/DESIGN.md,
// "Ordering").
type kafkaSink struct {
	producer  sarama.AsyncProducer
	marshaler kafka.Marshaler
	brokers   []string
	cfg       *sarama.Config

	// limits caches topics' max.message.bytes, read from the brokers when
	// one refuses a record as too large (explainTooLarge).
	limitsMu sync.Mutex
	limits   map[string]topicLimit

	mu     sync.RWMutex // guards closed against concurrent send
	closed bool
	done   chan struct{} // closed when the result loops end

	// missing remembers, per topic, when a broker last answered that it
	// does not exist (explainMissing).
	missingMu sync.Mutex
	missing   map[string]time.Time
	// anyMissing is whether missing has entries, so the acknowledgement
	// of every record need not take missingMu.
	anyMissing atomic.Bool
}

// missingTopicMemory is how long a broker's "unknown topic" answer explains
// the circuit-breaker errors that follow it. Sarama's breaker opens after
// three failed metadata refreshes and retries after 10 s; a topic that is
// still missing then answers "unknown topic" again, renewing it.
const missingTopicMemory = time.Minute

// missingTopicError is a publish failure because the topic does not exist:
// the broker said so, or Sarama's circuit breaker opened after it did.
// eventline creates no topics, and the error says what to do. It unwraps
// to the failure, so it is classified like it.
type missingTopicError struct {
	topic string
	err   error
}

func (e *missingTopicError) Error() string {
	return fmt.Sprintf("Kafka topic %q does not exist, and eventline creates no topics: create it (kafka-topics.sh --create --topic %s, or your cluster's tooling; for local development `eventline kafka-dev -topics %s`); the relay then publishes to it by itself: %v",
		e.topic, e.topic, e.topic, e.err)
}

func (e *missingTopicError) Unwrap() error { return e.err }

// explainMissing returns err, as a *missingTopicError when it says the
// topic does not exist (sarama.ErrUnknownTopicOrPartition) or is Sarama's
// "circuit breaker is open" within missingTopicMemory of such an answer
// for the same topic; otherwise the breaker error names no cause, and
// Kafka being unreachable opens it too. A success clears the memory.
func (s *kafkaSink) explainMissing(topic string, err error) error {
	if err == nil && !s.anyMissing.Load() {
		return nil // the common case: no topic is remembered as missing
	}
	s.missingMu.Lock()
	defer s.missingMu.Unlock()
	defer func() { s.anyMissing.Store(len(s.missing) > 0) }()
	now := time.Now()
	switch {
	case err == nil:
		delete(s.missing, topic)
		return nil
	case errors.Is(err, sarama.ErrUnknownTopicOrPartition):
		if s.missing == nil {
			s.missing = map[string]time.Time{}
		}
		s.missing[topic] = now
	case errors.Is(err, breaker.ErrBreakerOpen):
		if seen, ok := s.missing[topic]; !ok || now.Sub(seen) > missingTopicMemory {
			return err
		}
	default:
		return err
	}
	return &missingTopicError{topic: topic, err: err}
}

func newKafkaSink(brokers []string, cfg *sarama.Config) (*kafkaSink, error) {
	p, err := sarama.NewAsyncProducer(brokers, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to Kafka at %v: %w", brokers, err)
	}
	s := &kafkaSink{
		producer:  p,
		marshaler: kafka.NewWithPartitioningMarshaler(recordKey),
		brokers:   brokers,
		cfg:       cfg,
		done:      make(chan struct{}),
	}
	go s.results()
	return s, nil
}

// recordKey is the Kafka record key: the event's aggregate id.
func recordKey(_ string, msg *message.Message) (string, error) {
	id := msg.Metadata.Get(eventline.MetaAggregateID)
	if id == "" {
		return "", errors.New("message has no aggregate_id metadata")
	}
	return id, nil
}

// send queues msg for topic and reports the outcome to it.complete. It
// blocks while the producer's input buffer is full.
func (s *kafkaSink) send(ctx context.Context, topic string, msg *message.Message, it *item) error {
	pm, err := s.marshaler.Marshal(topic, msg)
	if err != nil {
		return &permanentError{fmt.Errorf("build Kafka record: %w", err)}
	}
	pm.Metadata = it
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed {
		return errSinkClosed
	}
	select {
	case s.producer.Input() <- pm:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *kafkaSink) results() {
	var wg sync.WaitGroup
	wg.Go(func() {
		for pm := range s.producer.Successes() {
			it := pm.Metadata.(*item)
			_ = s.explainMissing(pm.Topic, nil)
			it.endSpan(pm.Partition, pm.Offset, nil)
			it.complete(nil)
		}
	})
	wg.Go(func() {
		for pe := range s.producer.Errors() {
			it := pe.Msg.Metadata.(*item)
			err := s.explainMissing(pe.Msg.Topic, pe.Err)
			err = s.explainTooLarge(pe.Msg, err)
			it.endSpan(0, 0, err)
			it.complete(err)
		}
	})
	wg.Wait()
	close(s.done)
}

// close flushes queued records, reports their outcomes and stops.
func (s *kafkaSink) close() {
	s.mu.Lock()
	first := !s.closed
	s.closed = true
	s.mu.Unlock()
	if first {
		s.producer.AsyncClose()
	}
	<-s.done
}
