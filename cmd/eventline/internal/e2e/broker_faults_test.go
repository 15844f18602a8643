package e2e_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/kafkatest"
)

// The tests in this file take an Apache Kafka broker of their own down
// under load, for real: its JVM killed or frozen. They are skipped unless
// real-broker mode is on (make test-kafka).

// brokerDownFor is how long the killed broker stays down before it is
// restarted: the clients' retries (relay: one Sarama retry, 1 s network
// timeouts; consumers: 5 s) run out meanwhile.
const brokerDownFor = 10 * time.Second

// brokerFrozenFor is how long the broker's JVM is stopped: past the
// consumers' session timeout (6 s, faultRig.consumerConfig) and the
// broker's own registration timeout (broker.session.timeout.ms, 4 s), so
// that when it resumes, its group coordinator expires the consumers and
// its controller fences the broker for a moment.
const brokerFrozenFor = 15 * time.Second

// TestBrokerKilledUnderLoadLosesNothing kills the broker's JVM (SIGKILL)
// while events are published, relayed and consumed by two consumer groups,
// and restarts it on the same data directory 10 s later. Every committed
// event must be applied once, in per-aggregate order, by both groups,
// with nothing dead-lettered, parked or skipped (kafkaLoad.finish). The
// idempotent producer's state (producer ids, sequence numbers) is rebuilt
// by the broker from its log after the unclean shutdown; group offsets
// come back from __consumer_offsets.
func TestBrokerKilledUnderLoadLosesNothing(t *testing.T) {
	t.Parallel()
	kafkatest.NeedReal(t)
	k := kafkatest.Start(t, kafkatest.Config{Faults: true}) // a broker of its own, behind a fault proxy
	l := startKafkaLoad(t, k, "killed", loadTimeouts{consumer: kafkaNetTimeout, relay: kafkaRelayNetTimeout})

	published, retried, recovery := l.outage("after the broker was killed and restarted", brokerDownFor,
		k.Broker.Kill, func() error { return k.Broker.Restart(context.Background()) })
	t.Logf("broker killed with SIGKILL, down %s, answered %s after its restart; %d events published meanwhile, the relay retried %g times; caught up %s after the restart",
		brokerDownFor, k.Broker.StartupTime().Round(time.Millisecond), published, retried, recovery.Round(time.Millisecond))
	require.Positive(t, retried, "the relay's publishes failed while the broker was down")
	l.finish()
}

// TestBrokerFrozenPastTheSessionTimeoutLosesNothing stops the broker's JVM
// (SIGSTOP) for 15 s, longer than the consumers' session timeout, while
// events are published, relayed and consumed, then resumes it. No client
// connection closes: the clients' requests time out. On resuming, the
// broker finds every consumer's session expired and rebalances both
// groups, and its controller fences it until its next heartbeat (its
// partitions without a leader for a moment). Every committed event must be
// applied once, in per-aggregate order, by both groups, with nothing
// dead-lettered, parked or skipped.
func TestBrokerFrozenPastTheSessionTimeoutLosesNothing(t *testing.T) {
	t.Parallel()
	kafkatest.NeedReal(t)
	k := kafkatest.Start(t, kafkatest.Config{Faults: true}) // a broker of its own, behind a fault proxy
	l := startKafkaLoad(t, k, "frozen", loadTimeouts{consumer: kafkaNetTimeout, relay: kafkaRelayNetTimeout})

	published, retried, recovery := l.outage("after the broker resumed", brokerFrozenFor, k.Broker.Pause, k.Broker.Resume)
	t.Logf("broker frozen %s (consumer session timeout 6 s): %d events published meanwhile, the relay retried %g times; caught up %s after it resumed",
		brokerFrozenFor, published, retried, recovery.Round(time.Millisecond))
	l.finish()
}
