// Package kafkatest gives tests a Kafka cluster: the one named by
// KAFKA_BROKERS when set, otherwise an in-process kfake cluster reached over
// TCP. Each test gets its own topic names.
package kafkatest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/eventline/eventline/internal/devkafka"
	"github.com/eventline/eventline/internal/kafkaconf"
)

// Brokers returns broker addresses for the test: KAFKA_BROKERS when set,
// otherwise a kfake cluster that lives until the test ends.
func Brokers(t testing.TB) []string {
	t.Helper()
	if b := kafkaconf.BrokersFromEnv(); len(b) > 0 {
		return b
	}
	_, brokers := Fake(t)
	return brokers
}

// Fake starts a kfake cluster for tests that inject faults. It never uses
// KAFKA_BROKERS.
func Fake(t testing.TB, opts ...kfake.Opt) (*kfake.Cluster, []string) {
	t.Helper()
	c, err := devkafka.Start(0, opts...)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c, c.ListenAddrs()
}

// Topic returns a topic name unique to this test run.
func Topic(t testing.TB, prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

// CreateTopic creates a topic with the given partition count.
func CreateTopic(t testing.TB, brokers []string, topic string, partitions int32) {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	admin, err := sarama.NewClusterAdmin(brokers, cfg)
	require.NoError(t, err)
	defer admin.Close()
	err = admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false)
	if err != nil && !isTopicExists(err) {
		require.NoError(t, err)
	}
	// Wait until metadata shows the topic, so producers don't race creation.
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		md, err := admin.DescribeTopics([]string{topic})
		if err == nil && len(md) == 1 && md[0].Err == sarama.ErrNoError && len(md[0].Partitions) == int(partitions) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("topic %s did not appear", topic)
}

func isTopicExists(err error) bool {
	var te *sarama.TopicError
	return errors.As(err, &te) && te.Err == sarama.ErrTopicAlreadyExists
}

// Consume reads records from topic (all partitions, from the oldest offset)
// until fn returns true or the timeout passes.
func Consume(t testing.TB, brokers []string, topic string, timeout time.Duration, fn func(*sarama.ConsumerMessage) bool) {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	consumer, err := sarama.NewConsumer(brokers, cfg)
	require.NoError(t, err)
	defer consumer.Close()
	parts, err := consumer.Partitions(topic)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	msgs := make(chan *sarama.ConsumerMessage)
	for _, p := range parts {
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		require.NoError(t, err)
		defer pc.Close()
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
				return
			}
		case <-ctx.Done():
			return
		}
	}
}
