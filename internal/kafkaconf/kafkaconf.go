// Package kafkaconf builds the Sarama configurations eventline's Kafka
// clients run with, and reads broker addresses from the environment.
package kafkaconf

import (
	"errors"
	"os"
	"strings"
	"time"

	"github.com/IBM/sarama"
)

// BrokersEnv names the environment variable holding a comma-separated list
// of Kafka brokers ("host:port,host:port").
const BrokersEnv = "KAFKA_BROKERS"

// Version is the Kafka protocol version eventline asks Sarama to speak. 2.8
// is old enough for any supported cluster and new enough for idempotence.
var Version = sarama.V2_8_0_0

// BrokersFromEnv returns the brokers named by KAFKA_BROKERS, or nil.
func BrokersFromEnv() []string {
	return ParseBrokers(os.Getenv(BrokersEnv))
}

// ParseBrokers splits a comma-separated broker list, dropping blanks.
func ParseBrokers(s string) []string {
	var out []string
	for _, b := range strings.Split(s, ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	return out
}

// ValidateBrokers checks that brokers is non-empty and every entry looks
// like host:port.
func ValidateBrokers(field string, brokers []string) error {
	if len(brokers) == 0 {
		return errors.New(field + " is empty: give at least one Kafka broker as host:port (or set " + BrokersEnv + ")")
	}
	for _, b := range brokers {
		i := strings.LastIndexByte(b, ':')
		if i <= 0 || i == len(b)-1 {
			return errors.New(field + ": broker " + `"` + b + `"` + " is not host:port")
		}
	}
	return nil
}

// Producer returns the relay's producer configuration: idempotent, every
// in-sync replica acknowledges, one request in flight per broker so retries
// cannot reorder a partition, and records partitioned by key with Kafka's
// own murmur2 hash (the Java client's, Kafka Streams', franz-go's), so any
// other producer of the same keys agrees on their partitions.
func Producer(clientID string) *sarama.Config {
	c := sarama.NewConfig()
	c.ClientID = clientID
	c.Version = Version
	c.Producer.Idempotent = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Net.MaxOpenRequests = 1
	c.Producer.Retry.Max = 5
	c.Producer.Retry.Backoff = 100 * time.Millisecond
	c.Producer.Return.Successes = true
	c.Producer.Return.Errors = true
	c.Producer.Partitioner = sarama.NewMurmur2Partitioner
	c.Producer.Flush.Frequency = time.Millisecond
	c.Producer.Flush.MaxMessages = 1000
	c.Metadata.Retry.Backoff = 250 * time.Millisecond
	c.Metadata.AllowAutoTopicCreation = false
	return c
}

// Consumer returns a consumer-group configuration that starts a new group at
// the oldest offset, so a group created after events were published still
// sees them.
func Consumer(clientID string) *sarama.Config {
	c := sarama.NewConfig()
	c.ClientID = clientID
	c.Version = Version
	c.Consumer.Return.Errors = true
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.AutoCommit.Enable = true
	c.Consumer.Offsets.AutoCommit.Interval = time.Second
	c.Metadata.Retry.Backoff = 250 * time.Millisecond
	c.Metadata.AllowAutoTopicCreation = false
	return c
}
