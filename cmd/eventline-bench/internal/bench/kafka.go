package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/eventline/eventline"
)

// Partitions is the partition count of every topic the benchmark creates.
const Partitions = 12

// BrokersEnv names the environment variable listing the Kafka brokers,
// comma-separated host:port, as eventline's components read it.
const BrokersEnv = "KAFKA_BROKERS"

// kafkaVersion is the protocol version of the harness's Sarama clients,
// eventline's own.
var kafkaVersion = sarama.V2_8_0_0

// ParseBrokers splits a comma-separated broker list, dropping blanks.
func ParseBrokers(s string) []string {
	var out []string
	for b := range strings.SplitSeq(s, ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	return out
}

// ValidateBrokers checks that each broker is host:port; field names the
// flag in the error.
func ValidateBrokers(field string, brokers []string) error {
	if len(brokers) == 0 {
		return errors.New(field + " is empty: give at least one Kafka broker as host:port (or set " + BrokersEnv + ")")
	}
	for _, b := range brokers {
		i := strings.LastIndexByte(b, ':')
		if i <= 0 || i == len(b)-1 {
			return errors.New(field + ": broker \"" + b + "\" is not host:port")
		}
	}
	return nil
}

// consumerConfig is the Sarama configuration eventline's consumer uses by
// default: a new group starts at the oldest offset and marked offsets are
// committed every second. The baselines consume with it too, so the
// comparison is of what happens after a record arrives.
func consumerConfig(clientID string) *sarama.Config {
	c := sarama.NewConfig()
	c.ClientID = clientID
	c.Version = kafkaVersion
	c.Consumer.Return.Errors = true
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.AutoCommit.Enable = true
	c.Consumer.Offsets.AutoCommit.Interval = time.Second
	c.Metadata.Retry.Backoff = 250 * time.Millisecond
	c.Metadata.AllowAutoTopicCreation = false
	return c
}

// kafkaEnv is one scenario's Kafka: the configured brokers, or a kfake
// cluster started for the scenario and closed after it.
type kafkaEnv struct {
	brokers []string
	cluster *kfake.Cluster
	client  sarama.Client
	admin   sarama.ClusterAdmin
	topics  []string
}

func (e *env) kafka() (*kafkaEnv, error) {
	k := &kafkaEnv{brokers: e.cfg.Brokers}
	if len(k.brokers) == 0 {
		c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(Partitions))
		if err != nil {
			return nil, fmt.Errorf("start in-process Kafka (kfake): %w", err)
		}
		k.cluster, k.brokers = c, c.ListenAddrs()
	}
	cfg := sarama.NewConfig()
	cfg.Version = kafkaVersion
	client, err := sarama.NewClient(k.brokers, cfg)
	if err != nil {
		k.close()
		return nil, fmt.Errorf("connect to Kafka at %v: %w", k.brokers, err)
	}
	k.client = client
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		k.close()
		return nil, fmt.Errorf("connect the Kafka admin client: %w", err)
	}
	k.admin = admin
	return k, nil
}

// close deletes the topics the scenario created and stops kfake.
func (k *kafkaEnv) close() {
	if k.admin != nil {
		for _, t := range k.topics {
			_ = k.admin.DeleteTopic(t)
		}
		_ = k.admin.Close() // closes the client too
	} else if k.client != nil {
		_ = k.client.Close()
	}
	if k.cluster != nil {
		k.cluster.Close()
	}
}

// topic creates a fresh topic with Partitions partitions and waits until
// its metadata is visible.
func (k *kafkaEnv) topic(prefix string) (string, error) { return k.topicN(prefix, Partitions) }

// topicN creates a fresh topic with the given number of partitions and
// waits until its metadata is visible.
func (k *kafkaEnv) topicN(prefix string, partitions int32) (string, error) {
	var b [4]byte
	_, _ = rand.Read(b[:])
	topic := "bench." + prefix + "." + hex.EncodeToString(b[:])
	err := k.admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false)
	var te *sarama.TopicError
	exists := errors.As(err, &te) && te.Err == sarama.ErrTopicAlreadyExists
	if err != nil && !exists {
		return "", fmt.Errorf("create topic %s: %w", topic, err)
	}
	k.topics = append(k.topics, topic)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		md, err := k.admin.DescribeTopics([]string{topic})
		if err == nil && len(md) == 1 && md[0].Err == sarama.ErrNoError && len(md[0].Partitions) == int(partitions) {
			return topic, k.client.RefreshMetadata(topic)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return "", fmt.Errorf("topic %s did not appear", topic)
}

// records returns the number of records in topic: the sum of its
// partitions' high-water marks.
func (k *kafkaEnv) records(topic string) (int64, error) {
	var n int64
	for p := int32(0); p < Partitions; p++ {
		off, err := k.client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, fmt.Errorf("offset of %s/%d: %w", topic, p, err)
		}
		n += off
	}
	return n, nil
}

// aggregateKey keys Kafka records by aggregate id, like eventline's relay.
func aggregateKey(_ string, msg *message.Message) (string, error) {
	return msg.Metadata.Get(eventline.MetaAggregateID), nil
}

// fill writes msgs to topic through an async producer, keyed by aggregate,
// and waits for every acknowledgement.
func (k *kafkaEnv) fill(ctx context.Context, topic string, msgs []*message.Message) error {
	cfg := sarama.NewConfig()
	cfg.Version = kafkaVersion
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Producer.Flush.Frequency = time.Millisecond
	cfg.Producer.Flush.MaxMessages = 1000
	cfg.Producer.Partitioner = sarama.NewHashPartitioner
	p, err := sarama.NewAsyncProducer(k.brokers, cfg)
	if err != nil {
		return fmt.Errorf("fill producer: %w", err)
	}
	marshaler := kafka.NewWithPartitioningMarshaler(aggregateKey)
	errc := make(chan error, 1)
	go func() {
		var firstErr error
		for i := 0; i < len(msgs); i++ {
			select {
			case <-p.Successes():
			case pe := <-p.Errors():
				if firstErr == nil {
					firstErr = pe.Err
				}
			case <-ctx.Done():
				errc <- ctx.Err()
				return
			}
		}
		errc <- firstErr
	}()
	for _, m := range msgs {
		pm, err := marshaler.Marshal(topic, m)
		if err != nil {
			_ = p.Close()
			return err
		}
		select {
		case p.Input() <- pm:
		case <-ctx.Done():
			_ = p.Close()
			return ctx.Err()
		}
	}
	err = <-errc
	if cerr := p.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("fill topic %s: %w", topic, err)
	}
	return nil
}
