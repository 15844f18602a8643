package kafkatest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/eventline/eventline/internal/kafkabroker"
	"github.com/eventline/eventline/internal/kafkaconf"
)

// startWait bounds how long a test waits for its cluster, a broker of its
// own included (which may first wait for a free slot, see OwnBrokersEnv).
const startWait = 5 * time.Minute

// The helpers below take a testing.TB and fail the test on error. They do
// not use testify, so that eventlinetest/kafkatest, which users' tests
// import, does not bring it along.

// Start returns a cluster as cfg says, closed when the test ends. It fails
// the test if the cluster cannot be started or reached.
func Start(t testing.TB, cfg Config) *Cluster {
	t.Helper()
	if Real() && (cfg.Own || cfg.Faults) && !cfg.InProcess {
		requireBrokers(t)
	}
	ctx, cancel := context.WithTimeout(context.Background(), startWait)
	defer cancel()
	begin := time.Now()
	c, err := New(ctx, cfg)
	if err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(func() {
		if t.Failed() && c.Broker != nil {
			t.Logf("Apache Kafka broker %s, the end of its logs:\n%s", c.Broker.Addr(), c.Broker.LogTail(40))
		}
		c.Close()
	})
	if c.Broker != nil {
		t.Logf("Apache Kafka broker of its own at %s (pid %d), ready %s after the test asked (JVM start %s)",
			c.Brokers[0], c.Broker.Pid(), time.Since(begin).Round(time.Millisecond), c.Broker.StartupTime().Round(time.Millisecond))
	}
	return c
}

// Brokers returns broker addresses for the test: the shared cluster in
// real-broker mode, otherwise a kfake cluster that lives until the test
// ends.
func Brokers(t testing.TB) []string {
	t.Helper()
	if b := kafkaconf.BrokersFromEnv(); len(b) > 0 {
		return b
	}
	return Start(t, Config{}).Brokers
}

// WithFaults returns a Kafka of the test's own behind a fault proxy
// (Cluster.Proxy: Refuse, Drop, Freeze): kfake, or in real-broker mode an
// Apache Kafka broker started for the test that advertises the proxy's
// address. fakeOpts apply to kfake only.
func WithFaults(t testing.TB, fakeOpts ...kfake.Opt) *Cluster {
	t.Helper()
	return Start(t, Config{Faults: true, FakeOptions: fakeOpts})
}

// NeedReal skips the test unless real-broker mode is on.
func NeedReal(t testing.TB) {
	t.Helper()
	if !Real() {
		t.Skip("needs Apache Kafka: runs in make test-kafka (KAFKA_BROKERS set; Java 17+ and Maven, see README \"Against a real Kafka\")")
	}
}

// requireBrokers fails the test when real-broker mode is on but no broker
// can be started here.
func requireBrokers(t testing.TB) {
	t.Helper()
	if err := kafkabroker.Available(); err != nil {
		t.Fatalf("KAFKA_BROKERS is set (real-broker mode) and this test needs an Apache Kafka broker of its own, but none can be started here: %v", err)
	}
}

// Fake starts a kfake cluster, whatever the mode, for tests that need what
// only kfake does (Cluster.ControlKey, kfake options).
func Fake(t testing.TB, opts ...kfake.Opt) (*kfake.Cluster, []string) {
	t.Helper()
	c := Start(t, Config{InProcess: true, FakeOptions: opts})
	return c.Fake, c.Brokers
}

// Topic returns a topic (or group) name unique to this test run.
func Topic(t testing.TB, prefix string) string { return UniqueName(prefix) }

// UniqueName returns prefix with a random suffix ("orders-3fa2c1d0").
func UniqueName(prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

// CreateTopic creates topic on brokers with the given partition count and
// waits until every partition has a leader. It is never deleted: tests
// that share a cluster may share a topic name, and the brokers of
// real-broker mode live only as long as the test run.
func CreateTopic(t testing.TB, brokers []string, topic string, partitions int32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), topicWait)
	defer cancel()
	if _, err := CreateTopics(ctx, brokers, partitions, nil, topic); err != nil {
		t.Fatalf("%v", err)
	}
}

// Consume reads records from topic (all partitions, from the oldest
// offset) until fn returns true or the timeout passes.
func Consume(t testing.TB, brokers []string, topic string, timeout time.Duration, fn func(*sarama.ConsumerMessage) bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := consume(ctx, brokers, topic, fn); err != nil {
		t.Fatalf("kafkatest: consume %s: %v", topic, err)
	}
}
