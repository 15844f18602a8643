package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline"
)

// Publish writes events to topic, in order, as eventline's relay does. The
// public test kit's Publish (eventlinetest/kafkatest) documents it.
func Publish(ctx context.Context, brokers []string, topic string, events ...eventline.Event) error {
	if len(events) == 0 {
		return nil
	}
	msgs := make([]*message.Message, 0, len(events))
	for i, e := range events {
		msg, err := eventline.Encode(e)
		if err != nil {
			return fmt.Errorf("kafkatest.Publish: event %d: %w", i, err)
		}
		msg.SetContext(ctx)
		msgs = append(msgs, msg)
	}
	return PublishMessages(brokers, topic, msgs...)
}

// PublishMessages writes Watermill messages to topic as they are, with
// Publish's keys and partitioning; see eventlinetest/kafkatest's.
func PublishMessages(brokers []string, topic string, msgs ...*message.Message) error {
	cfg := saramaConfig()
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Producer.Partitioner = sarama.NewMurmur2Partitioner
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: brokers,
		Marshaler: kafka.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) {
			if k := msg.Metadata.Get(eventline.MetaAggregateID); k != "" {
				return k, nil
			}
			return msg.UUID, nil
		}),
		OverwriteSaramaConfig: cfg,
	}, watermill.NopLogger{})
	if err != nil {
		return fmt.Errorf("kafkatest: connect a publisher to %s: %w", strings.Join(brokers, ","), err)
	}
	err = pub.Publish(topic, msgs...)
	if cerr := pub.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("kafkatest: publish to %s: %w", topic, err)
	}
	return nil
}

// Record is one Kafka record, with the eventline envelope's ids read from
// its headers.
type Record struct {
	Partition int32
	Offset    int64
	Key       string
	EventID   string
	// Version is the aggregate_version header, as written.
	Version string
	Value   []byte
}

// ReadTopic returns every record in topic, partition by partition, oldest
// first: what a new consumer group would receive.
func ReadTopic(ctx context.Context, brokers []string, topic string) ([]Record, error) {
	client, err := sarama.NewClient(brokers, saramaConfig())
	if err != nil {
		return nil, fmt.Errorf("kafkatest: connect to Kafka at %s: %w", strings.Join(brokers, ","), err)
	}
	defer client.Close()
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, err
	}
	defer consumer.Close()
	parts, err := client.Partitions(topic)
	if err != nil {
		return nil, fmt.Errorf("kafkatest: read topic %s: %w", topic, err)
	}
	var out []Record
	for _, p := range parts {
		end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, fmt.Errorf("kafkatest: read topic %s: %w", topic, err)
		}
		start, err := client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, fmt.Errorf("kafkatest: read topic %s: %w", topic, err)
		}
		if start >= end {
			continue
		}
		pc, err := consumer.ConsumePartition(topic, p, start)
		if err != nil {
			return nil, fmt.Errorf("kafkatest: read topic %s: %w", topic, err)
		}
		for off := start; off < end; {
			select {
			case m := <-pc.Messages():
				r := Record{Partition: m.Partition, Offset: m.Offset, Key: string(m.Key), Value: m.Value}
				for _, h := range m.Headers {
					switch string(h.Key) {
					case eventline.MetaEventID:
						r.EventID = string(h.Value)
					case eventline.MetaAggregateVersion:
						r.Version = string(h.Value)
					}
				}
				out = append(out, r)
				off = m.Offset + 1
			case <-ctx.Done():
				_ = pc.Close()
				return nil, ctx.Err()
			case <-time.After(10 * time.Second):
				_ = pc.Close()
				return nil, fmt.Errorf("kafkatest: read topic %s: partition %d stopped short of offset %d", topic, p, end)
			}
		}
		if err := pc.Close(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// consume reads records from topic (all partitions, from the oldest offset)
// until fn returns true or ctx ends.
func consume(ctx context.Context, brokers []string, topic string, fn func(*sarama.ConsumerMessage) bool) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // last: the partition consumers' goroutines end
	consumer, err := sarama.NewConsumer(brokers, saramaConfig())
	if err != nil {
		return err
	}
	defer consumer.Close()
	parts, err := consumer.Partitions(topic)
	if err != nil {
		return err
	}
	msgs := make(chan *sarama.ConsumerMessage)
	var pcs []sarama.PartitionConsumer
	defer func() {
		for _, pc := range pcs {
			_ = pc.Close()
		}
	}()
	for _, p := range parts {
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		for err != nil && retriable(err) {
			// A partition that moved or has just been created: its leader
			// serves it in a moment.
			select {
			case <-ctx.Done():
				return err
			case <-time.After(50 * time.Millisecond):
			}
			pc, err = consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		}
		if err != nil {
			return err
		}
		pcs = append(pcs, pc)
		go func() {
			for m := range pc.Messages() {
				select {
				case msgs <- m:
				case <-ctx.Done():
					return
				}
			}
		}()
	}
	for {
		select {
		case m := <-msgs:
			if fn(m) {
				return nil
			}
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return nil // the caller's time is up: as far as it reads
			}
			return ctx.Err()
		}
	}
}

// retriable reports whether a Kafka error passes once leadership settles.
func retriable(err error) bool {
	var kerr sarama.KError
	return errors.As(err, &kerr) && (kerr == sarama.ErrNotLeaderForPartition || kerr == sarama.ErrLeaderNotAvailable ||
		kerr == sarama.ErrUnknownTopicOrPartition || kerr == sarama.ErrNotCoordinatorForConsumer)
}
