package kafkatest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/eventline/eventline"
)

// BrokersEnv names the environment variable that, when set to a
// comma-separated host:port list, makes Start use that cluster instead of
// an in-process one.
const BrokersEnv = "KAFKA_BROKERS"

// DefaultPartitions is the partition count of the topics Start creates.
const DefaultPartitions = 4

// topicWait bounds how long Start and CreateTopic wait for new topics to
// appear in the cluster's metadata.
const topicWait = 30 * time.Second

// Config tunes StartWith. The zero value is what Start uses.
type Config struct {
	// Topics are created before StartWith returns. On a real cluster,
	// topics that already exist are used as they are and left in place;
	// the others are deleted when the test ends.
	Topics []string
	// Partitions is the partition count of each topic created. Defaults
	// to DefaultPartitions (4).
	Partitions int32
	// InProcess always starts an in-process cluster, even when
	// KAFKA_BROKERS is set: for tests that inject faults through
	// Cluster.Fake.
	InProcess bool
	// AutoCreateTopics lets the in-process cluster create a topic on first
	// use, as some development clusters do. Defaults to false, like a
	// production cluster: eventline creates no topics, so a test that
	// forgets one fails as production would.
	AutoCreateTopics bool
	// FakeOptions are passed to kfake.NewCluster for the in-process
	// cluster (for example kfake.SeedTopics or kfake.NumBrokers).
	FakeOptions []kfake.Opt
}

// Cluster is a Kafka cluster for tests.
type Cluster struct {
	// Brokers are the bootstrap addresses, host:port, to give clients
	// (consumer.Config.Brokers, producer.RelayConfig.Brokers…).
	Brokers []string
	// Fake is the in-process cluster, for fault injection
	// (Fake.ControlKey…); nil when KAFKA_BROKERS named a real cluster.
	Fake *kfake.Cluster

	partitions int32
	mu         sync.Mutex
	created    []string
}

// Start returns a cluster for the test with the given topics created
// (DefaultPartitions partitions each): the cluster named by KAFKA_BROKERS
// when it is set, otherwise a new in-process one on a free port of
// 127.0.0.1. Everything is cleaned up when the test ends. It fails the
// test when the cluster cannot be started or reached.
func Start(t testing.TB, topics ...string) *Cluster {
	t.Helper()
	return StartWith(t, Config{Topics: topics})
}

// StartWith is Start with options.
func StartWith(t testing.TB, cfg Config) *Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), topicWait)
	defer cancel()
	c, err := New(ctx, cfg)
	if err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// New is Start outside a test, for a TestMain that shares one cluster
// among a package's tests. Close it when done.
func New(ctx context.Context, cfg Config) (*Cluster, error) {
	if cfg.Partitions <= 0 {
		cfg.Partitions = DefaultPartitions
	}
	c := &Cluster{partitions: cfg.Partitions}
	if env := BrokersFromEnv(); len(env) > 0 && !cfg.InProcess {
		c.Brokers = env
	} else {
		opts := []kfake.Opt{kfake.NumBrokers(1), kfake.Ports(0), kfake.DefaultNumPartitions(int(cfg.Partitions))}
		if cfg.AutoCreateTopics {
			opts = append(opts, kfake.AllowAutoTopicCreation())
		}
		fake, err := kfake.NewCluster(append(opts, cfg.FakeOptions...)...)
		if err != nil {
			return nil, fmt.Errorf("kafkatest: start the in-process Kafka cluster (kfake): %w", err)
		}
		c.Fake, c.Brokers = fake, fake.ListenAddrs()
	}
	if err := c.CreateTopics(ctx, cfg.Partitions, cfg.Topics...); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// Close deletes, on a real cluster, the topics this Cluster created, and
// stops an in-process cluster.
func (c *Cluster) Close() {
	if c.Fake != nil {
		c.Fake.Close()
		return
	}
	c.mu.Lock()
	topics := c.created
	c.created = nil
	c.mu.Unlock()
	if len(topics) == 0 {
		return
	}
	admin, err := sarama.NewClusterAdmin(c.Brokers, c.saramaConfig())
	if err != nil {
		return
	}
	defer admin.Close()
	for _, t := range topics {
		_ = admin.DeleteTopic(t)
	}
}

// BrokersFromEnv returns the brokers listed in KAFKA_BROKERS, or nil.
func BrokersFromEnv() []string {
	var out []string
	for _, b := range strings.Split(os.Getenv(BrokersEnv), ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	return out
}

// InProcess reports whether the cluster runs in this process.
func (c *Cluster) InProcess() bool { return c.Fake != nil }

// Topic returns prefix with a random suffix ("orders-3fa2c1d0"), for
// topic and group names that must not meet an earlier run's on a shared
// cluster. It creates nothing.
func Topic(prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

// CreateTopic creates topic with the given partition count (0 means the
// cluster's default for Start) and waits until the cluster's metadata
// shows it, failing the test if it cannot. See CreateTopics.
func (c *Cluster) CreateTopic(t testing.TB, topic string, partitions int32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), topicWait)
	defer cancel()
	if err := c.CreateTopics(ctx, partitions, topic); err != nil {
		t.Fatalf("%v", err)
	}
}

// CreateTopics creates topics with the given partition count (0 means the
// cluster's default) and waits until the cluster's metadata shows them.
// Topics that already exist are left as they are. On a real cluster,
// Close deletes the topics CreateTopics created.
func (c *Cluster) CreateTopics(ctx context.Context, partitions int32, topics ...string) error {
	if len(topics) == 0 {
		return nil
	}
	if partitions <= 0 {
		partitions = c.partitions
	}
	admin, err := sarama.NewClusterAdmin(c.Brokers, c.saramaConfig())
	if err != nil {
		return fmt.Errorf("kafkatest: connect to Kafka at %s: %w", strings.Join(c.Brokers, ","), err)
	}
	defer admin.Close()
	for _, topic := range topics {
		if err := eventline.ValidateTopic(topic); err != nil {
			return fmt.Errorf("kafkatest: %w", err)
		}
		err = admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false)
		var te *sarama.TopicError
		switch {
		case err == nil:
			c.mu.Lock()
			c.created = append(c.created, topic)
			c.mu.Unlock()
		case errors.As(err, &te) && te.Err == sarama.ErrTopicAlreadyExists:
		default:
			return fmt.Errorf("kafkatest: create topic %s on %s: %w", topic, strings.Join(c.Brokers, ","), err)
		}
	}
	for {
		md, err := admin.DescribeTopics(topics)
		ready := err == nil && len(md) == len(topics)
		for _, m := range md {
			ready = ready && m.Err == sarama.ErrNoError && len(m.Partitions) > 0
		}
		if ready {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kafkatest: topics %s did not appear in the cluster metadata: %w", strings.Join(topics, ", "), context.Cause(ctx))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (c *Cluster) saramaConfig() *sarama.Config {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	cfg.ClientID = "eventline-kafkatest"
	return cfg
}

// Publish writes events to topic, in order, as eventline's relay does:
// encoded by eventline.Encode (an event without an ID gets one), keyed by
// aggregate id, with watermill-kafka's default marshaler, so each lands in
// its aggregate's partition and any eventline consumer reads it. Use it to
// feed a consumer, or to deliver an event again, or out of order, on
// purpose. Events are written as given: set AggregateVersion yourself
// (the producer would assign it).
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

// PublishMessages writes Watermill messages to topic as they are, keyed by
// their aggregate_id metadata (or their UUID when there is none): for
// records eventline.Encode would refuse, to test how a consumer treats bad
// input.
func PublishMessages(brokers []string, topic string, msgs ...*message.Message) error {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	cfg.ClientID = "eventline-kafkatest"
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Producer.Partitioner = sarama.NewHashPartitioner
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
