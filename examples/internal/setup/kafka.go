package setup

import (
	"context"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
)

// Kafka is the cluster an example runs against: the one named by
// KAFKA_BROKERS, or else a kfake cluster started in this process and
// reached over TCP like any broker. It is internal/kafkatest's cluster
// (Brokers, CreateTopics, SetTopicConfig, Close…), with names made unique
// to the run. Close stops the in-process cluster, or on a shared cluster
// deletes the topics and consumer groups of this run.
type Kafka struct {
	*kafkatest.Cluster
	suffix string
}

// StartKafka returns the cluster in brokers, or when brokers is empty, a new
// in-process one.
func StartKafka(brokers []string) (*Kafka, error) {
	c, err := kafkatest.New(context.Background(), kafkatest.Config{Brokers: brokers, InProcess: len(brokers) == 0, Partitions: 12})
	if err != nil {
		return nil, err
	}
	return &Kafka{Cluster: c, suffix: kafkatest.UniqueName("")[1:7]}, nil
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
	k.DeleteGroupsOnClose(g)
	return g
}

// ReadTopic returns every record in topic, partition by partition, oldest
// first: what a new consumer group would receive.
func (k *Kafka) ReadTopic(ctx context.Context, topic string) ([]kafkatest.Record, error) {
	return kafkatest.ReadTopic(ctx, k.Brokers, topic)
}

// PublishEvents writes events straight to Kafka, in the given order,
// encoded by eventline.Encode and keyed by aggregate id, the way the relay
// publishes them, so each lands in its aggregate's partition. The examples
// use it to deliver events a second time, or out of order, on purpose.
func PublishEvents(brokers []string, topic string, events []eventline.Event) error {
	return kafkatest.Publish(context.Background(), brokers, topic, events...)
}
