package kafkatest

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
)

// BrokersEnv names the environment variable that, when set to a
// comma-separated host:port list, makes Start use that cluster instead of
// an in-process one.
const BrokersEnv = kafkaconf.BrokersEnv

// DefaultPartitions is the partition count of the topics Start creates.
const DefaultPartitions = kafkatest.DefaultPartitions

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

	c *kafkatest.Cluster
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
	c, err := kafkatest.New(ctx, kafkatest.Config{
		Topics: cfg.Topics, Partitions: cfg.Partitions, InProcess: cfg.InProcess,
		AutoCreateTopics: cfg.AutoCreateTopics, FakeOptions: cfg.FakeOptions,
	})
	if err != nil {
		return nil, err
	}
	return &Cluster{Brokers: c.Brokers, Fake: c.Fake, c: c}, nil
}

// Close deletes, on a real cluster, the topics this Cluster created, and
// stops an in-process cluster.
func (c *Cluster) Close() { c.c.Close() }

// BrokersFromEnv returns the brokers listed in KAFKA_BROKERS, or nil.
func BrokersFromEnv() []string { return kafkaconf.BrokersFromEnv() }

// InProcess reports whether the cluster runs in this process.
func (c *Cluster) InProcess() bool { return c.Fake != nil }

// Topic returns prefix with a random suffix ("orders-3fa2c1d0"), for
// topic and group names that must not meet an earlier run's on a shared
// cluster. It creates nothing.
func Topic(prefix string) string { return kafkatest.UniqueName(prefix) }

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
// cluster's default) and waits until every partition has a leader in the
// cluster's metadata. Topics that already exist are left as they are. On
// a real cluster, Close deletes the topics CreateTopics created.
func (c *Cluster) CreateTopics(ctx context.Context, partitions int32, topics ...string) error {
	return c.c.CreateTopics(ctx, partitions, topics...)
}

// Publish writes events to topic, in order, as eventline's relay does:
// encoded by eventline.Encode (an event without an ID gets one), keyed by
// aggregate id and partitioned by Kafka's murmur2 hash (the relay's
// default, and the Java client's), so each lands in the partition the
// relay would put it in, and any eventline consumer reads it. Use it to
// feed a consumer, or to deliver an event again, or out of order, on
// purpose. Events are written as given: set AggregateVersion yourself
// (the producer would assign it).
func Publish(ctx context.Context, brokers []string, topic string, events ...eventline.Event) error {
	return kafkatest.Publish(ctx, brokers, topic, events...)
}

// PublishMessages writes Watermill messages to topic as they are, keyed by
// their aggregate_id metadata (or their UUID when there is none), with
// Publish's partitioning: for records eventline.Encode would refuse, to
// test how a consumer treats bad input.
func PublishMessages(brokers []string, topic string, msgs ...*message.Message) error {
	return kafkatest.PublishMessages(brokers, topic, msgs...)
}
