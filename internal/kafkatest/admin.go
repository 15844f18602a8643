package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/IBM/sarama"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkaconf"
)

// topicWait bounds the waits for topic changes to show in the metadata.
const topicWait = 30 * time.Second

// waitUntil calls done every 20 ms until it returns true, for at most
// topicWait; otherwise it returns why it stopped waiting.
func waitUntil(ctx context.Context, done func() bool) error {
	ctx, cancel := context.WithTimeout(ctx, topicWait)
	defer cancel()
	for !done() {
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-time.After(20 * time.Millisecond): // polling interval
		}
	}
	return nil
}

// saramaConfig is the configuration of the helpers' own clients.
func saramaConfig() *sarama.Config {
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	cfg.ClientID = "eventline-kafkatest"
	return cfg
}

// Admin connects a cluster admin client; close it when done.
func Admin(brokers []string) (sarama.ClusterAdmin, error) {
	admin, err := sarama.NewClusterAdmin(brokers, saramaConfig())
	if err != nil {
		return nil, fmt.Errorf("kafkatest: connect to Kafka at %s: %w", strings.Join(brokers, ","), err)
	}
	return admin, nil
}

// CreateTopics creates topics with the given partition count (0 means
// Config.Partitions) and waits until every partition has a leader.
// Topics that exist are left as they are. On the shared cluster, Close
// deletes the topics it created.
func (c *Cluster) CreateTopics(ctx context.Context, partitions int32, topics ...string) error {
	return c.CreateTopicsWithConfig(ctx, partitions, nil, topics...)
}

// CreateTopicsWithConfig is CreateTopics with topic configuration
// overrides (say, max.message.bytes).
func (c *Cluster) CreateTopicsWithConfig(ctx context.Context, partitions int32, config map[string]string, topics ...string) error {
	if partitions <= 0 {
		partitions = c.cfg.Partitions
	}
	created, err := CreateTopics(ctx, c.Brokers, partitions, config, topics...)
	c.mu.Lock()
	c.created = append(c.created, created...)
	c.mu.Unlock()
	return err
}

// CreateTopics creates topics on brokers and waits until every partition
// is served (WaitServed). It returns the topics it created (not those that
// existed).
func CreateTopics(ctx context.Context, brokers []string, partitions int32, config map[string]string, topics ...string) ([]string, error) {
	if len(topics) == 0 {
		return nil, nil
	}
	admin, err := Admin(brokers)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	entries := map[string]*string{}
	for name, v := range config {
		entries[name] = &v
	}
	var created []string
	for _, topic := range topics {
		if err := eventline.ValidateTopic(topic); err != nil {
			return created, fmt.Errorf("kafkatest: %w", err)
		}
		err = admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1, ConfigEntries: entries}, false)
		var te *sarama.TopicError
		switch {
		case err == nil:
			created = append(created, topic)
		case errors.As(err, &te) && te.Err == sarama.ErrTopicAlreadyExists:
		default:
			return created, fmt.Errorf("kafkatest: create topic %s on %s: %w", topic, strings.Join(brokers, ","), err)
		}
	}
	return created, WaitServed(ctx, brokers, 1, topics...)
}

// WaitServed waits until each of topics has at least partitions
// partitions, and every one answers a ListOffsets request: a new partition
// of Apache Kafka has no leader for a moment (a producer then fails with
// LEADER_NOT_AVAILABLE), and the metadata names its leader a moment before
// that broker serves it (a consumer starting then got
// NOT_LEADER_OR_FOLLOWER: producer.TestRelayPartitionsLikeKafkasJavaClient,
// once in a make test-kafka run).
func WaitServed(ctx context.Context, brokers []string, partitions int, topics ...string) error {
	ctx, cancel := context.WithTimeout(ctx, topicWait) // for all of them
	defer cancel()
	client, err := sarama.NewClient(brokers, saramaConfig())
	if err != nil {
		return fmt.Errorf("kafkatest: connect to Kafka at %s: %w", strings.Join(brokers, ","), err)
	}
	defer client.Close()
	for _, topic := range topics {
		var err error
		served := func() bool {
			err = client.RefreshMetadata(topic)
			var parts []int32
			if err == nil {
				parts, err = client.Partitions(topic)
			}
			if err == nil && len(parts) < partitions {
				err = fmt.Errorf("%d partitions of %d", len(parts), partitions)
			}
			for _, p := range parts {
				if err == nil {
					_, err = client.GetOffset(topic, p, sarama.OffsetNewest)
				}
			}
			return err == nil
		}
		if cause := waitUntil(ctx, served); cause != nil {
			return fmt.Errorf("kafkatest: topic %s not served by its leaders: %w (%w)", topic, err, cause)
		}
	}
	return nil
}

// SetTopicConfig sets one configuration entry of a topic (the topic's other
// overrides stay).
func (c *Cluster) SetTopicConfig(topic, name, value string) error {
	admin, err := Admin(c.Brokers)
	if err != nil {
		return err
	}
	defer admin.Close()
	err = admin.IncrementalAlterConfig(sarama.TopicResource, topic, map[string]sarama.IncrementalAlterConfigsEntry{
		name: {Operation: sarama.IncrementalAlterConfigsOperationSet, Value: &value},
	}, false)
	if err != nil {
		return fmt.Errorf("kafkatest: alter %s of topic %s: %w", name, topic, err)
	}
	// Apache Kafka applies the change once the broker has read it from the
	// metadata log, a moment after answering (kfake at once): a produce
	// right after may still see the old value. Wait until the broker
	// describes the new one.
	err = waitUntil(context.Background(), func() bool {
		entries, err := admin.DescribeConfig(sarama.ConfigResource{Type: sarama.TopicResource, Name: topic, ConfigNames: []string{name}})
		if err != nil {
			return false
		}
		for _, e := range entries {
			if e.Name == name && e.Value == value {
				return true
			}
		}
		return false
	})
	if err != nil {
		return fmt.Errorf("kafkatest: %s of topic %s not applied by the broker: %w", name, topic, err)
	}
	return nil
}

// DeleteGroupsOnClose has Close delete these consumer groups on the shared
// cluster.
func (c *Cluster) DeleteGroupsOnClose(groups ...string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.groups = append(c.groups, groups...)
}

// deleteOnClose deletes, best effort, what a run left on the shared cluster.
func (c *Cluster) deleteOnClose(topics, groups []string) {
	admin, err := Admin(c.Brokers)
	if err != nil {
		return
	}
	defer admin.Close()
	for _, g := range groups {
		_ = admin.DeleteConsumerGroup(g) // a group that never joined does not exist
	}
	for _, t := range topics {
		_ = admin.DeleteTopic(t)
	}
}
