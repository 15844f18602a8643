package main

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
)

// relayArgs are the flags of a quick test relay for env on brokers.
func relayArgs(env pgtest.Env, brokers []string, extra ...string) []string {
	args := append(dbArgs(env.Schema), "relay", "-brokers", strings.Join(brokers, ","),
		"-poll-interval", "100ms", "-rebalance-interval", "100ms", "-cleanup-interval", "0")
	return append(args, extra...)
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

func TestRelayRunsUntilCancelledAndServesMetrics(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, "orders")
	kafkatest.CreateTopic(t, brokers, topic, 3)
	events := publish(t, env, topic, "a", "b", "c", "a")
	// A consumer group with one parked event, for the group status collector.
	_, err := env.Pool.Exec(context.Background(), `INSERT INTO `+sqlident.Qualify(env.Schema, "aggregate_versions")+
		` (consumer_group, aggregate_type, aggregate_id, version) VALUES ('billing','order','a',1);
		INSERT INTO `+sqlident.Qualify(env.Schema, "parked_events")+
		` (consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version, event_id, event_type, payload, metadata)
		VALUES ('billing','order','a',3,2,'e3','order.updated','\x7b7d','{}')`)
	require.NoError(t, err)

	relay := start(t, relayArgs(env, brokers, "-metrics-addr", "127.0.0.1:0", "-batch-size", "2", "-max-publish-rate", "1000")...)
	logs := waitOutput(t, relay, relay.stderr, "serving metrics")
	m := regexp.MustCompile(`url=(http://\S+/metrics)`).FindStringSubmatch(logs)
	require.NotNil(t, m, "the metrics URL is logged")

	seen := eventIDs(t, brokers, topic, len(events))
	for _, e := range events {
		require.True(t, seen[e.ID], "event %s reached Kafka", e.ID)
	}
	st := waitDrained(t, env)
	require.EqualValues(t, 4, st.Outbox.Shards[0].Stored+st.Outbox.Shards[1].Stored, "-cleanup-interval 0 keeps relayed rows")
	require.Eventually(t, func() bool {
		st := okJSON[statusJSON](t, env.Schema, "status", "-json")
		return st.Outbox.OwnedShards == 2
	}, time.Minute, 50*time.Millisecond, "status shows the relay owning both shards")

	body := scrape(t, m[1])
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
	_, err = get(m[1])
	require.Error(t, err, "the metrics server is shut down")
}

// TestRelayMetricsWithoutConsumerTables: on a producer-only schema (its
// consumers keep their tables in another database) the relay's metrics
// serve no eventline_group_* series, not a failing scrape nor a
// eventline_group_status_up 0 that would page for nothing.
func TestRelayMetricsWithoutConsumerTables(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	_, err := env.Pool.Exec(context.Background(), `DROP TABLE `+strings.Join([]string{
		sqlident.Qualify(env.Schema, "skipped_versions"), sqlident.Qualify(env.Schema, "parked_events"),
		sqlident.Qualify(env.Schema, "aggregate_versions"), sqlident.Qualify(env.Schema, "processed_events"),
	}, ", "))
	require.NoError(t, err)
	brokers := kafkatest.Brokers(t)

	relay := start(t, relayArgs(env, brokers, "-metrics-addr", "127.0.0.1:0")...)
	logs := waitOutput(t, relay, relay.stderr, "serving metrics")
	m := regexp.MustCompile(`url=(http://\S+/metrics)`).FindStringSubmatch(logs)
	require.NotNil(t, m, "the metrics URL is logged")
	body := scrape(t, m[1])
	require.Contains(t, body, "eventline_outbox_up 1")
	require.NotContains(t, body, "eventline_group_")
	require.Equal(t, exitOK, relay.stop(t))
}

func TestRelayFailsClearlyWhenNotMigrated(t *testing.T) {
	t.Parallel()
	schema := pgtest.NewSchemaName(t)
	r := cli(t, append(dbArgs(schema), "relay", "-brokers", "127.0.0.1:1")...)
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "not migrated")
	require.Contains(t, r.stderr, "eventline migrate up")
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
