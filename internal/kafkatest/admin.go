package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"slices"
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
// has a leader (a new topic of Apache Kafka has none for a moment, and a
// producer then fails with LEADER_NOT_AVAILABLE). It returns the topics it
// created (not those that existed).
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
	err = waitTopics(ctx, admin, topics, func(m *sarama.TopicMetadata) bool {
		if m.Err != sarama.ErrNoError || len(m.Partitions) == 0 {
			return false
		}
		for _, p := range m.Partitions {
			if p.Err != sarama.ErrNoError || p.Leader < 0 {
				return false
			}
		}
		return true
	})
	if err != nil {
		return created, err
	}
	return created, waitServed(ctx, brokers, topics)
}

// waitServed waits until every partition of topics answers a ListOffsets
// request. Apache Kafka's metadata names a new partition's leader a moment
// before that broker serves it: a consumer starting then got
// NOT_LEADER_OR_FOLLOWER (producer.TestRelayPartitionsLikeKafkasJavaClient,
// once in a make test-kafka run).
func waitServed(ctx context.Context, brokers []string, topics []string) error {
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

// waitTopics waits until ok holds for every topic's metadata.
func waitTopics(ctx context.Context, admin sarama.ClusterAdmin, topics []string, ok func(*sarama.TopicMetadata) bool) error {
	err := waitUntil(ctx, func() bool {
		md, err := admin.DescribeTopics(topics)
		ready := err == nil && len(md) == len(topics)
		for _, m := range md {
			ready = ready && ok(m)
		}
		return ready
	})
	if err != nil {
		return fmt.Errorf("kafkatest: topics %s not ready in the cluster metadata: %w", strings.Join(topics, ", "), err)
	}
	return nil
}

// SetTopicConfig sets one configuration entry of a topic (the topic's other
// overrides stay).
func (c *Cluster) SetTopicConfig(topic, name, value string) error {
	return c.alterTopicConfig(topic, name, &value)
}

// ResetTopicConfig removes an override, back to the broker's default.
func (c *Cluster) ResetTopicConfig(topic, name string) error {
	return c.alterTopicConfig(topic, name, nil)
}

func (c *Cluster) alterTopicConfig(topic, name string, value *string) error {
	admin, err := Admin(c.Brokers)
	if err != nil {
		return err
	}
	defer admin.Close()
	op := sarama.IncrementalAlterConfigsOperationSet
	if value == nil {
		op = sarama.IncrementalAlterConfigsOperationDelete
	}
	err = admin.IncrementalAlterConfig(sarama.TopicResource, topic, map[string]sarama.IncrementalAlterConfigsEntry{
		name: {Operation: op, Value: value},
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
		applied := value == nil // a removed override: the broker's default, whatever it is
		for _, e := range entries {
			if e.Name == name {
				applied = value == nil && e.Source != sarama.SourceTopic || value != nil && e.Value == *value
			}
		}
		return applied
	})
	if err != nil {
		return fmt.Errorf("kafkatest: %s of topic %s not applied by the broker: %w", name, topic, err)
	}
	return nil
}

// AddPartitions raises topic's partition count to total and waits until
// the new partitions have leaders.
func (c *Cluster) AddPartitions(ctx context.Context, topic string, total int32) error {
	admin, err := Admin(c.Brokers)
	if err != nil {
		return err
	}
	defer admin.Close()
	if err := admin.CreatePartitions(topic, total, nil, false); err != nil {
		return fmt.Errorf("kafkatest: add partitions to %s: %w", topic, err)
	}
	err = waitTopics(ctx, admin, []string{topic}, func(m *sarama.TopicMetadata) bool {
		if m.Err != sarama.ErrNoError || len(m.Partitions) != int(total) {
			return false
		}
		for _, p := range m.Partitions {
			if p.Leader < 0 {
				return false
			}
		}
		return true
	})
	if err != nil {
		return err
	}
	return waitServed(ctx, c.Brokers, []string{topic})
}

// DeleteTopics deletes topics and waits until the metadata no longer lists
// them.
func (c *Cluster) DeleteTopics(ctx context.Context, topics ...string) error {
	admin, err := Admin(c.Brokers)
	if err != nil {
		return err
	}
	defer admin.Close()
	for _, t := range topics {
		if err := admin.DeleteTopic(t); err != nil {
			return fmt.Errorf("kafkatest: delete topic %s: %w", t, err)
		}
	}
	c.mu.Lock()
	c.created = slices.DeleteFunc(c.created, func(t string) bool { return slices.Contains(topics, t) })
	c.mu.Unlock()
	err = waitUntil(ctx, func() bool {
		listed, err := admin.ListTopics()
		gone := err == nil
		for _, t := range topics {
			_, ok := listed[t]
			gone = gone && !ok
		}
		return gone
	})
	if err != nil {
		return fmt.Errorf("kafkatest: topics %s still listed after deletion: %w", strings.Join(topics, ", "), err)
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
