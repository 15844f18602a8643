package main

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
)

func TestRelay(t *testing.T) {
	t.Parallel()

	t.Run("runs until cancelled and serves metrics", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 2, 3)
		env := b.env
		events := publish(t, env, b.topic, "a", "b", "c", "a")
		// A consumer group with one parked event, for the group status collector.
		_, err := env.Pool.Exec(context.Background(), `INSERT INTO `+sqlident.Qualify(env.Schema, "aggregate_versions")+
			` (consumer_group, aggregate_type, aggregate_id, version) VALUES ('billing','order','a',1);
			INSERT INTO `+sqlident.Qualify(env.Schema, "parked_events")+
			` (consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version, event_id, event_type, payload, metadata)
			VALUES ('billing','order','a',3,2,'e3','order.updated','\x7b7d','{}')`)
		require.NoError(t, err)

		relay := start(t, b.relayArgs("-metrics-addr", "127.0.0.1:0", "-batch-size", "2", "-max-publish-rate", "1000")...)
		url := metricsURL(t, relay)
		seen := eventIDs(t, b.brokers, b.topic, len(events))
		for _, e := range events {
			require.True(t, seen[e.ID], "event %s reached Kafka", e.ID)
		}
		st := waitDrained(t, env)
		require.EqualValues(t, 4, st.Outbox.Shards[0].Stored+st.Outbox.Shards[1].Stored, "-cleanup-interval 0 keeps relayed rows")
		waitOwnedShards(t, env, 2)

		body := scrape(t, url)
		require.Contains(t, body, `eventline_outbox_backlog{shard="0"} 0`, "status collector")
		require.Contains(t, body, `eventline_outbox_up 1`)
		require.Regexp(t, `eventline_relay_forwarded_total\{shard="\d"\} [1-4]`, body, "relay metrics")
		require.Contains(t, body, "eventline_group_status_up 1", "group status collector")
		require.Contains(t, body, `eventline_group_parked_events{group="billing"} 1`)
		require.Contains(t, body, `eventline_group_open_gaps{group="billing"} 1`)
		require.Contains(t, body, "go_goroutines ", "Go collector")
		require.Contains(t, body, "process_", "process collector")

		require.Equal(t, exitOK, relay.stop(t), "a cancelled relay stops cleanly")
		require.Contains(t, relay.stderr.String(), "relay stopping: finishing the batches in flight")
		st = okJSON[statusJSON](t, env.Schema, "status", "-json")
		require.Zero(t, st.Outbox.OwnedShards, "the relay released its shards")
		_, err = get(url)
		require.Error(t, err, "the metrics server is shut down")
	})

	// On a producer-only schema (its consumers keep their tables in another
	// database) the relay's metrics serve no eventline_group_* series, not a
	// failing scrape nor a eventline_group_status_up 0 that would page for
	// nothing.
	t.Run("metrics without consumer tables", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 1, 0)
		env := b.env
		_, err := env.Pool.Exec(context.Background(), `DROP TABLE `+strings.Join([]string{
			sqlident.Qualify(env.Schema, "skipped_versions"), sqlident.Qualify(env.Schema, "parked_events"),
			sqlident.Qualify(env.Schema, "aggregate_versions"), sqlident.Qualify(env.Schema, "processed_events"),
		}, ", "))
		require.NoError(t, err)
		b.brokers = kafkatest.Brokers(t)

		relay := start(t, b.relayArgs("-metrics-addr", "127.0.0.1:0")...)
		body := scrape(t, metricsURL(t, relay))
		require.Contains(t, body, "eventline_outbox_up 1")
		require.NotContains(t, body, "eventline_group_")
		require.Equal(t, exitOK, relay.stop(t))
	})

	t.Run("fails clearly when not migrated", func(t *testing.T) {
		t.Parallel()
		schema := pgtest.NewSchemaName(t)
		r := cli(t, append(dbArgs(schema), "relay", "-brokers", "127.0.0.1:1")...)
		require.Equal(t, exitFailure, r.code)
		require.Contains(t, r.stderr, "not migrated")
		require.Contains(t, r.stderr, "eventline migrate up")
	})

	// Started while PostgreSQL refuses connections, it waits for it, saying
	// so, and relays once it answers; it stops cleanly. Before, it exited 1 at
	// once: "cannot connect to PostgreSQL".
	t.Run("started during a database outage waits for it", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 2, 3)
		events := publish(t, b.env, b.topic, "a", "b", "c")
		proxy := startPGProxy(t)
		proxy.Set(faultproxy.Refuse)

		relay := start(t, b.proxiedRelayArgs(proxy)...)
		require.Eventually(t, func() bool { return relay.exited() || proxy.Refused() >= 3 }, time.Minute, 20*time.Millisecond,
			"the relay tries the database several times")
		require.False(t, relay.exited(), "the relay exited during the outage:\n%s", relay.stderr)
		require.Contains(t, relay.stderr.String(), "PostgreSQL is unavailable; waiting for it before relaying")

		proxy.Set(faultproxy.Pass)
		seen := eventIDs(t, b.brokers, b.topic, len(events))
		for _, e := range events {
			require.True(t, seen[e.ID], "event %s reached Kafka once the database answered", e.ID)
		}
		require.Equal(t, exitOK, relay.stop(t))
	})

	t.Run("stopped during a database outage exits cleanly", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 2, 0)
		b.brokers = []string{"127.0.0.1:1"}
		proxy := startPGProxy(t)
		proxy.Set(faultproxy.Refuse)
		relay := start(t, b.proxiedRelayArgs(proxy)...)
		require.Eventually(t, func() bool { return relay.exited() || proxy.Refused() >= 1 }, time.Minute, 20*time.Millisecond)
		require.False(t, relay.exited(), "the relay exited during the outage:\n%s", relay.stderr)
		require.Equal(t, exitOK, relay.stop(t), "%s", relay.stderr)
		require.Contains(t, relay.stderr.String(), "relay stopped before the database answered")
	})

	// The real main, with its signal handling, exits 0 on SIGTERM after
	// releasing its shards, as its help says. (The cause signal.NotifyContext
	// gives its context, "terminated signal received", is context.Canceled for
	// errors.Is; the relay's clean-stop checks rely on that or on comparing it
	// with the caller's cause.)
	t.Run("exits zero on SIGTERM", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 2, 3)
		events := publish(t, b.env, b.topic, "a", "b")

		child := startChild(t, b.relayArgs()...)
		seen := eventIDs(t, b.brokers, b.topic, len(events))
		require.Len(t, seen, len(events), "the child relay relays")
		waitOwnedShards(t, b.env, 2)

		require.NoError(t, child.Signal(syscall.SIGTERM))
		select {
		case <-child.Done():
		case <-time.After(time.Minute):
			t.Fatal("the relay did not exit within a minute of SIGTERM")
		}
		require.NoError(t, child.Err(), "exit status 0 after SIGTERM")
		st := okJSON[statusJSON](t, b.env.Schema, "status", "-json")
		require.Zero(t, st.Outbox.OwnedShards, "the relay released its shards")
	})
}

// waitDrained waits until status shows no backlog and returns it.
func waitDrained(t *testing.T, env pgtest.Env) statusJSON {
	t.Helper()
	var st statusJSON
	require.Eventually(t, func() bool {
		var out, errw syncBuffer
		if runWithEnv(context.Background(), append(dbArgs(env.Schema), "status", "-json"), &out, &errw, noEnv) != 0 {
			return false
		}
		st = statusJSON{}
		return jsonUnmarshal(out.String(), &st) == nil && st.Outbox.Backlog == 0
	}, time.Minute, 50*time.Millisecond, "the relay did not drain the outbox")
	return st
}

// waitOwnedShards waits until status shows relays owning n shards.
func waitOwnedShards(t *testing.T, env pgtest.Env, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		return okJSON[statusJSON](t, env.Schema, "status", "-json").Outbox.OwnedShards == n
	}, time.Minute, 50*time.Millisecond, "status shows relays owning %d shards", n)
}

// eventIDs reads topic until want distinct event ids were seen (or the
// timeout passed) and returns them.
func eventIDs(t *testing.T, brokers []string, topic string, want int) map[string]bool {
	t.Helper()
	seen := map[string]bool{}
	kafkatest.Consume(t, brokers, topic, 30*time.Second, func(m *sarama.ConsumerMessage) bool {
		for _, h := range m.Headers {
			if string(h.Key) == eventline.MetaEventID {
				seen[string(h.Value)] = true
			}
		}
		return len(seen) >= want
	})
	return seen
}

// proxiedRelayArgs are relayArgs with the database reached through proxy.
func (b testBundle) proxiedRelayArgs(proxy *faultproxy.Proxy) []string {
	args := b.relayArgs()
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

// metricsURL waits for the relay to log where it serves metrics.
func metricsURL(t *testing.T, relay *background) string {
	t.Helper()
	logs := waitOutput(t, relay, relay.stderr, "serving metrics")
	m := regexp.MustCompile(`url=(http://\S+/metrics)`).FindStringSubmatch(logs)
	require.NotNil(t, m, "the metrics URL is logged")
	return m[1]
}

// scrape returns the body of a successful GET.
func scrape(t *testing.T, url string) string {
	t.Helper()
	resp, err := get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

// get sends a GET on a fresh connection (no idle connections outlive it).
func get(url string) (*http.Response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		cancel()
		return nil, err
	}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Do(req)
	if err != nil {
		cancel()
		return nil, err
	}
	resp.Body = cancelOnClose{resp.Body, cancel}
	return resp, nil
}

type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (c cancelOnClose) Close() error {
	defer c.cancel()
	return c.ReadCloser.Close()
}
