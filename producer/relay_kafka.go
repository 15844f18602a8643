package producer

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

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
// partition in send order.
type kafkaSink struct {
	producer  sarama.AsyncProducer
	marshaler kafka.Marshaler

	mu     sync.RWMutex // guards closed against concurrent send
	closed bool
	done   chan struct{} // closed when the result loops end
}

func newKafkaSink(brokers []string, cfg *sarama.Config) (*kafkaSink, error) {
	p, err := sarama.NewAsyncProducer(brokers, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to Kafka at %v: %w", brokers, err)
	}
	s := &kafkaSink{
		producer:  p,
		marshaler: kafka.NewWithPartitioningMarshaler(recordKey),
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
	wg.Add(2)
	go func() {
		defer wg.Done()
		for pm := range s.producer.Successes() {
			it := pm.Metadata.(*item)
			it.endSpan(pm.Partition, pm.Offset, nil)
			it.complete(nil)
		}
	}()
	go func() {
		defer wg.Done()
		for pe := range s.producer.Errors() {
			it := pe.Msg.Metadata.(*item)
			it.endSpan(0, 0, pe.Err)
			it.complete(pe.Err)
		}
	}()
	wg.Wait()
	close(s.done)
}

// close flushes queued records, reports their outcomes and stops.
func (s *kafkaSink) close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		<-s.done
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.producer.AsyncClose()
	<-s.done
	return nil
}
