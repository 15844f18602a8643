package main

import (
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
)

// proxiedRelayArgs are relayArgs with the database reached through proxy.
func proxiedRelayArgs(env pgtest.Env, proxy *faultproxy.Proxy, brokers []string) []string {
	args := relayArgs(env, brokers)
	for i := range args {
		if args[i] == "-database-url" {
			args[i+1] = pgtest.URLVia(proxy.Addr())
		}
	}
	return args
}

func startPGProxy(t *testing.T) *faultproxy.Proxy {
	t.Helper()
	proxy, err := faultproxy.Start(pgtest.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	return proxy
}

// `eventline relay` started while PostgreSQL refuses connections waits
// for it, saying so, and relays once it answers; it stops cleanly. Before,
// it exited 1 at once: "cannot connect to PostgreSQL".
func TestRelayStartedDuringADatabaseOutageWaitsForIt(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, "orders")
	kafkatest.CreateTopic(t, brokers, topic, 3)
	events := publish(t, env, topic, "a", "b", "c")
	proxy := startPGProxy(t)
	proxy.Set(faultproxy.Refuse)

	relay := start(t, proxiedRelayArgs(env, proxy, brokers)...)
	require.Eventually(t, func() bool { return relay.exited() || proxy.Refused() >= 3 }, time.Minute, 20*time.Millisecond,
		"the relay tries the database several times")
	require.False(t, relay.exited(), "the relay exited during the outage:\n%s", relay.stderr)
	require.Contains(t, relay.stderr.String(), "PostgreSQL is unavailable; waiting for it before relaying")

	proxy.Set(faultproxy.Pass)
	seen := eventIDs(t, brokers, topic, len(events))
	for _, e := range events {
		require.True(t, seen[e.ID], "event %s reached Kafka once the database answered", e.ID)
	}
	require.Equal(t, exitOK, relay.stop(t))
}

// A relay stopped while it waits for the database exits 0.
func TestRelayStoppedDuringADatabaseOutageExitsCleanly(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	proxy := startPGProxy(t)
	proxy.Set(faultproxy.Refuse)
	relay := start(t, proxiedRelayArgs(env, proxy, []string{"127.0.0.1:1"})...)
	require.Eventually(t, func() bool { return relay.exited() || proxy.Refused() >= 1 }, time.Minute, 20*time.Millisecond)
	require.False(t, relay.exited(), "the relay exited during the outage:\n%s", relay.stderr)
	require.Equal(t, exitOK, relay.stop(t), "%s", relay.stderr)
	require.Contains(t, relay.stderr.String(), "relay stopped before the database answered")
}

// `eventline relay`, the real main with its signal handling, exits 0 on
// SIGTERM after releasing its shards, as its help says. (The cause
// signal.NotifyContext gives its context, "terminated signal received",
// is context.Canceled for errors.Is; the relay's clean-stop checks rely on
// that or on comparing it with the caller's cause. A guard: it passed
// before this change too.)
func TestRelayExitsZeroOnSIGTERM(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, "orders")
	kafkatest.CreateTopic(t, brokers, topic, 3)
	events := publish(t, env, topic, "a", "b")

	child := startChild(t, relayArgs(env, brokers)...)
	seen := eventIDs(t, brokers, topic, len(events))
	require.Len(t, seen, len(events), "the child relay relays")
	require.Eventually(t, func() bool {
		st := okJSON[statusJSON](t, env.Schema, "status", "-json")
		return st.Outbox.OwnedShards == 2
	}, time.Minute, 50*time.Millisecond, "the child relay owns both shards")

	require.NoError(t, child.Signal(syscall.SIGTERM))
	select {
	case <-child.Done():
	case <-time.After(time.Minute):
		t.Fatal("the relay did not exit within a minute of SIGTERM")
	}
	require.NoError(t, child.Err(), "exit status 0 after SIGTERM")
	st := okJSON[statusJSON](t, env.Schema, "status", "-json")
	require.Zero(t, st.Outbox.OwnedShards, "the relay released its shards")
}
