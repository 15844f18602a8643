package setup

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/devkafka"
	"github.com/eventline/eventline/internal/kafkaconf"
)

// Kafka is the cluster an example runs against: the one named by
// KAFKA_BROKERS, or else a kfake cluster started in this process and
// reached over TCP like any broker.
type Kafka struct {
	// Brokers are the bootstrap addresses to give eventline's configs.
	Brokers []string
	// InProcess is true when the cluster is kfake, started by StartKafka.
	InProcess bool

	cluster *kfake.Cluster
	suffix  string
	topics  []string
	groups  []string
}

// StartKafka returns the cluster in brokers, or when brokers is empty, a new
// in-process one.
func StartKafka(brokers []string) (*Kafka, error) {
	var b [3]byte
	_, _ = rand.Read(b[:])
	k := &Kafka{Brokers: brokers, suffix: hex.EncodeToString(b[:])}
	if len(brokers) > 0 {
		return k, nil
	}
	c, err := devkafka.Start(0)
	if err != nil {
		return nil, err
	}
	k.cluster, k.Brokers, k.InProcess = c, c.ListenAddrs(), true
	return k, nil
}

// BrokersFromEnv returns the brokers in KAFKA_BROKERS, or nil.
func BrokersFromEnv() []string { return kafkaconf.BrokersFromEnv() }

// Topic returns name made unique to this run ("orders-3fa2c1"), so a run
// against a shared cluster never reads an earlier run's records.
func (k *Kafka) Topic(name string) string { return name + "-" + k.suffix }

// Group returns a consumer group name unique to this run ("billing-3fa2c1"),
// so a run against a shared cluster never joins someone else's group. Close
// deletes the groups on a shared cluster.
func (k *Kafka) Group(name string) string {
	g := name + "-" + k.suffix
	k.groups = append(k.groups, g)
	return g
}

// CreateTopics creates topics with the given partition count and waits
// until the cluster's metadata shows them. Close deletes them again.
func (k *Kafka) CreateTopics(ctx context.Context, partitions int32, topics ...string) error {
	return k.CreateTopicsWithConfig(ctx, partitions, nil, topics...)
}

// CreateTopicsWithConfig is CreateTopics with topic configuration overrides
// (say, max.message.bytes).
func (k *Kafka) CreateTopicsWithConfig(ctx context.Context, partitions int32, config map[string]string, topics ...string) error {
	admin, err := k.admin()
	if err != nil {
		return err
	}
	defer admin.Close()
	entries := map[string]*string{}
	for name, v := range config {
		entries[name] = &v
	}
	for _, t := range topics {
		err := admin.CreateTopic(t, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1, ConfigEntries: entries}, false)
		var te *sarama.TopicError
		if err != nil && (!errors.As(err, &te) || te.Err != sarama.ErrTopicAlreadyExists) {
			return fmt.Errorf("create Kafka topic %s: %w", t, err)
		}
		k.topics = append(k.topics, t)
	}
	return WaitFor(ctx, 30*time.Second, "the new topics to appear in the cluster metadata", func() (bool, error) {
		md, err := admin.DescribeTopics(topics)
		if err != nil {
			return false, nil
		}
		for _, m := range md {
			if m.Err != sarama.ErrNoError || len(m.Partitions) != int(partitions) {
				return false, nil
			}
		}
		return true, nil
	})
}

// SetTopicConfig sets one configuration entry of a topic (an incremental
// change: the topic's other overrides stay).
func (k *Kafka) SetTopicConfig(topic, name, value string) error {
	admin, err := k.admin()
	if err != nil {
		return err
	}
	defer admin.Close()
	err = admin.IncrementalAlterConfig(sarama.TopicResource, topic, map[string]sarama.IncrementalAlterConfigsEntry{
		name: {Operation: sarama.IncrementalAlterConfigsOperationSet, Value: &value},
	}, false)
	if err != nil {
		return fmt.Errorf("set %s=%s on Kafka topic %s: %w", name, value, topic, err)
	}
	return nil
}

// Close stops the in-process cluster, or on a shared cluster deletes the
// topics and consumer groups of this run.
func (k *Kafka) Close() error {
	if k.cluster != nil {
		k.cluster.Close()
		return nil
	}
	if len(k.topics)+len(k.groups) == 0 {
		return nil
	}
	admin, err := k.admin()
	if err != nil {
		return err
	}
	defer admin.Close()
	for _, g := range k.groups {
		// Best effort: a group that never joined does not exist.
		_ = admin.DeleteConsumerGroup(g)
	}
	var errs []error
	for _, t := range k.topics {
		if err := admin.DeleteTopic(t); err != nil {
			errs = append(errs, fmt.Errorf("delete Kafka topic %s: %w", t, err))
		}
	}
	return errors.Join(errs...)
}

func (k *Kafka) admin() (sarama.ClusterAdmin, error) {
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	admin, err := sarama.NewClusterAdmin(k.Brokers, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to Kafka at %v: %w", k.Brokers, err)
	}
	return admin, nil
}

// Record is one Kafka record, with the eventline envelope read from its
// headers.
type Record struct {
	Partition int32
	Offset    int64
	Key       string
	EventID   string
	Version   string
}

// ReadTopic returns every record in topic, partition by partition, oldest
// first: what a new consumer group would receive.
func (k *Kafka) ReadTopic(ctx context.Context, topic string) ([]Record, error) {
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	client, err := sarama.NewClient(k.Brokers, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to Kafka at %v: %w", k.Brokers, err)
	}
	defer client.Close()
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, err
	}
	defer consumer.Close()
	parts, err := client.Partitions(topic)
	if err != nil {
		return nil, fmt.Errorf("read topic %s: %w", topic, err)
	}
	var out []Record
	for _, p := range parts {
		end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, fmt.Errorf("read topic %s: %w", topic, err)
		}
		start, err := client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, fmt.Errorf("read topic %s: %w", topic, err)
		}
		if start >= end {
			continue
		}
		pc, err := consumer.ConsumePartition(topic, p, start)
		if err != nil {
			return nil, fmt.Errorf("read topic %s: %w", topic, err)
		}
		for off := start; off < end; {
			select {
			case m := <-pc.Messages():
				r := Record{Partition: m.Partition, Offset: m.Offset, Key: string(m.Key)}
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
				return nil, fmt.Errorf("read topic %s: partition %d stopped short of offset %d", topic, p, end)
			}
		}
		if err := pc.Close(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// PublishEvents writes events straight to Kafka, in the given order, with a
// plain watermill-kafka publisher: encoded by eventline.Encode and keyed by
// aggregate id, the way the relay publishes them, so each lands in its
// aggregate's partition. The examples use it to deliver events a second
// time, or out of order, on purpose.
func PublishEvents(brokers []string, topic string, events []eventline.Event) error {
	if len(events) == 0 {
		return nil
	}
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: brokers,
		Marshaler: kafka.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) {
			return msg.Metadata.Get(eventline.MetaAggregateID), nil
		}),
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	msgs := make([]*message.Message, 0, len(events))
	for _, e := range events {
		msg, err := eventline.Encode(e)
		if err != nil {
			return errors.Join(err, pub.Close())
		}
		msgs = append(msgs, msg)
	}
	return errors.Join(pub.Publish(topic, msgs...), pub.Close())
}
