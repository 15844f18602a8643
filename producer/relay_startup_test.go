package producer_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/producer"
)

// runInBackground runs r until the returned stop is called, and returns
// Run's result channel (filled once).
func runInBackground(t *testing.T, r *producer.Relay) (done chan error, stop context.CancelFunc) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done = make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Error("relay did not stop within a minute")
		}
	})
	return done, cancel
}

// returned reports whether Run has returned, leaving its result for the
// clean-up.
func returned(done chan error) bool {
	select {
	case err := <-done:
		done <- err
		return true
	default:
		return false
	}
}

// A relay started while its database refuses connections, or accepts them
// and never answers, waits for it and then relays. Before, NewRelay failed
// on the refused connection ("read outbox shard count: failed to
// connect"), so a relay process started during a database restart or
// failover exited, and `eventline relay` with it.
func TestRelayStartedDuringADatabaseOutageWaitsForIt(t *testing.T) {
	t.Parallel()
	for name, mode := range map[string]faultproxy.Mode{"refused": faultproxy.Refuse, "not answering": faultproxy.Freeze} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 2}, 3)
			events := relaytest.PublishOrders(t, env, topic, 4, 20, 5)

			proxy := startProxy(t)
			proxy.Set(mode)
			pool := proxiedPool(t, proxy, producer.PoolSizeFor(env.Shards))
			logs := newLogRecorder(t, slog.LevelInfo)
			r, err := producer.NewRelay(context.Background(), pool, producer.RelayConfig{
				Schema: env.Schema, Brokers: brokers, Logger: slog.New(logs),
				PollInterval: 200 * time.Millisecond, RebalanceInterval: 250 * time.Millisecond,
			})
			require.NoError(t, err, "an unavailable database is not a configuration error")
			require.Zero(t, producer.ShardCount(r), "the shard count is not known yet")

			done, stop := runInBackground(t, r)
			waits := func() int {
				n := 0
				for _, l := range logs.at(slog.LevelWarn) {
					if strings.Contains(l, "PostgreSQL is unavailable; waiting for it before relaying") {
						n++
					}
				}
				return n
			}
			require.Eventually(t, func() bool { return returned(done) || waits() >= 2 }, time.Minute, 10*time.Millisecond,
				"the relay tries the database several times, saying so")
			require.False(t, returned(done), "Run returned during the outage: %v", logs.at(slog.LevelWarn))
			require.Empty(t, logs.at(slog.LevelError))

			proxy.Set(faultproxy.Pass)
			counts := relaytest.Distinct(relaytest.ReadTopic(t, brokers, topic, len(events), time.Minute))
			require.Len(t, counts, len(events), "the relay relays once the database answers")
			require.Equal(t, env.Shards, producer.ShardCount(r))
			stop()
			require.NoError(t, <-done)
			done <- nil
			require.Empty(t, logs.at(slog.LevelError))
		})
	}
}

// A relay stopped while it waits for the database returns nil, and one
// whose schema turns out not to be migrated when the database answers
// fails with ErrNotMigrated: that is a configuration error, not an outage.
func TestRelayStartedDuringADatabaseOutageStillRefusesAnUnmigratedSchema(t *testing.T) {
	t.Parallel()
	proxy := startProxy(t)
	proxy.Set(faultproxy.Refuse)
	pool := proxiedPool(t, proxy, producer.PoolSizeFor(4))
	newRelay := func(schema string) *producer.Relay {
		r, err := producer.NewRelay(context.Background(), pool, producer.RelayConfig{
			Schema: schema, Brokers: []string{"127.0.0.1:1"}, Logger: relaytest.Logger(t),
		})
		require.NoError(t, err)
		return r
	}

	stopped := newRelay("missing_schema")
	done, stop := runInBackground(t, stopped)
	require.Eventually(t, func() bool { return returned(done) || proxy.Refused() >= 2 }, time.Minute, 10*time.Millisecond)
	require.False(t, returned(done), "Run returned during the outage")
	stop()
	require.NoError(t, <-done, "a stop during the wait is clean")
	done <- nil

	unmigrated := newRelay("missing_schema")
	done, _ = runInBackground(t, unmigrated)
	before := proxy.Refused()
	require.Eventually(t, func() bool { return returned(done) || proxy.Refused() > before }, time.Minute, 10*time.Millisecond)
	require.False(t, returned(done), "Run returned during the outage")
	proxy.Set(faultproxy.Pass)
	var runErr error
	require.Eventually(t, func() bool {
		select {
		case runErr = <-done:
			done <- runErr
			return true
		default:
			return false
		}
	}, time.Minute, 10*time.Millisecond, "Run fails once the database answers")
	require.ErrorIs(t, runErr, producer.ErrNotMigrated)

	// With the database up, NewRelay reports it at once, as before.
	_, err := producer.NewRelay(context.Background(), pool, producer.RelayConfig{Schema: "missing_schema", Brokers: []string{"127.0.0.1:1"}})
	require.ErrorIs(t, err, producer.ErrNotMigrated)
}

// A caller's deadline, or a cancel with a cause, is a request to stop: Run
// returns nil and logs "relay stopped" at INFO, not at ERROR. Before, Run
// returned context.DeadlineExceeded and logged ERROR "relay stopped" for
// any cause but context.Canceled.
func TestRelayRunStopsCleanlyAtTheCallersDeadline(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	brokers := kafkatest.Brokers(t)
	for name, cause := range map[string]error{
		"deadline": context.DeadlineExceeded,
		"cause":    errors.New("the service is shutting down"),
	} {
		t.Run(name, func(t *testing.T) {
			logs := newLogRecorder(t, slog.LevelInfo)
			r, err := producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{
				Schema: env.Schema, Brokers: brokers, Logger: slog.New(logs),
				PollInterval: 200 * time.Millisecond, RebalanceInterval: 250 * time.Millisecond,
			})
			require.NoError(t, err)
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx) }()
			require.Eventually(t, func() bool { return len(producer.OwnedShards(r)) == env.Shards }, time.Minute, 10*time.Millisecond)
			cancel(cause) // what a context.WithTimeout does when its time is up
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(time.Minute):
				t.Fatal("relay did not stop within a minute")
			}
			require.Empty(t, logs.at(slog.LevelError))
			require.True(t, slices.ContainsFunc(logs.at(slog.LevelInfo), func(l string) bool { return strings.HasPrefix(l, "INFO relay stopped ") }),
				"an INFO line says the relay stopped")
		})
	}

	// And with a real deadline.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	logs := newLogRecorder(t, slog.LevelError)
	r, err := producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{Schema: env.Schema, Brokers: brokers, Logger: slog.New(logs)})
	require.NoError(t, err)
	require.NoError(t, r.Run(ctx))
	require.Empty(t, logs.at(slog.LevelError))
}

// When an event's topic does not exist, the relay's publish errors say so
// and what to do, also once Sarama's circuit breaker opens and its errors
// become a bare "circuit breaker is open"; and once the topic is created,
// the relay publishes to it by itself. Before, after the first attempts
// every error was "circuit breaker is open", with no hint of the cause.
func TestRelayNamesAMissingTopic(t *testing.T) {
	t.Parallel()
	brokers := kafkatest.Brokers(t) // like a production cluster: no topic created on first use
	missing := kafkatest.Topic(t, "missing")
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	events := relaytest.PublishOrders(t, env, missing, 1, 1, 1)

	logs := newLogRecorder(t, slog.LevelWarn)
	relaytest.Start(t, env, producer.RelayConfig{
		Brokers: brokers, Logger: slog.New(logs),
		Backoff: eventline.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond, Multiplier: 1}, MaxAttempts: 1000, // never dead-lettered here
	})
	hinted := func(l string) bool {
		return strings.Contains(l, `Kafka topic "`+missing+`" does not exist, and eventline creates no topics`) &&
			strings.Contains(l, "eventline kafka-dev -topics "+missing)
	}
	var breakerLine string
	require.Eventually(t, func() bool {
		for _, l := range logs.at(slog.LevelWarn) {
			if strings.Contains(l, "publish failed") && strings.Contains(l, "circuit breaker is open") {
				breakerLine = l
				return true
			}
		}
		return false
	}, time.Minute, 20*time.Millisecond, "Sarama's breaker opens")
	require.True(t, hinted(breakerLine), "the breaker's error names the missing topic: %s", breakerLine)
	for _, l := range logs.at(slog.LevelWarn) {
		if strings.Contains(l, "publish failed") {
			require.True(t, hinted(l), "every publish failure names the missing topic: %s", l)
		}
	}

	kafkatest.CreateTopic(t, brokers, missing, 1)
	require.Len(t, relaytest.Distinct(relaytest.ReadTopic(t, brokers, missing, len(events), time.Minute)), len(events), "published once the topic exists")
}
