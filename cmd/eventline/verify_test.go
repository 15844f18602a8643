package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
)

// verifyJSON mirrors the parts of `eventline verify -json` the tests read.
type verifyJSON struct {
	OK       bool   `json:"ok"`
	Problems int64  `json:"problems"`
	Warnings int64  `json:"warnings"`
	Schema   string `json:"schema"`
	Separate bool   `json:"separate_consumer_database"`
	Outbox   struct {
		Events      int64 `json:"events"`
		Relayed     int64 `json:"relayed"`
		Pending     int64 `json:"pending"`
		DeadLetters int64 `json:"dead_letters"`
	} `json:"outbox"`
	Kafka struct {
		Checked bool `json:"checked"`
		Topics  []struct {
			Topic   string `json:"topic"`
			Records int64  `json:"records"`
		} `json:"topics"`
	} `json:"kafka"`
	Groups []struct {
		Group        string           `json:"group"`
		Topics       []string         `json:"topics"`
		TopicsFrom   string           `json:"topics_from"`
		Events       int64            `json:"events"`
		Outcomes     map[string]int64 `json:"outcomes"`
		Pending      int64            `json:"pending"`
		Stuck        int64            `json:"stuck"`
		Lost         int64            `json:"lost"`
		AppliedTwice *int64           `json:"applied_twice"`
		OutOfOrder   int64            `json:"out_of_order"`
		Parked       int64            `json:"parked"`
		SkippedGaps  int64            `json:"skipped_gaps"`
	} `json:"groups"`
	Findings []struct {
		Severity         string `json:"severity"`
		Kind             string `json:"kind"`
		Group            string `json:"group"`
		EventID          string `json:"event_id"`
		AggregateType    string `json:"aggregate_type"`
		AggregateID      string `json:"aggregate_id"`
		AggregateVersion int64  `json:"aggregate_version"`
		ToVersion        int64  `json:"to_version"`
		Stage            string `json:"stage"`
		Detail           string `json:"detail"`
	} `json:"findings"`
	Notes []string `json:"notes"`
}

// verifyRun runs `eventline verify` against schema and returns the result.
func verifyRun(t *testing.T, schema string, args ...string) result {
	t.Helper()
	return cli(t, append(append(dbArgs(schema), "verify"), args...)...)
}

// markRelayed moves every shard's relay position past its last row.
func markRelayed(t *testing.T, env pgtest.Env) {
	t.Helper()
	for s := 0; s < env.Shards; s++ {
		_, err := env.Pool.Exec(context.Background(), `INSERT INTO `+sqlident.Qualify(env.Schema, outbox.OffsetsTable(s))+`
			(consumer_group, offset_acked, last_processed_transaction_id)
			SELECT $1, "offset", transaction_id FROM `+sqlident.Qualify(env.Schema, outbox.Table(s))+`
			ORDER BY transaction_id DESC, "offset" DESC LIMIT 1
			ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = excluded.offset_acked,
				last_processed_transaction_id = excluded.last_processed_transaction_id`, outbox.RelayConsumerGroup)
		require.NoError(t, err)
	}
}

// recordApplied writes a group's dedup record of an applied event, in a
// transaction of its own, advances the version and adds an effect.
func recordApplied(t *testing.T, env pgtest.Env, group string, e eventline.Event, ago time.Duration) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "processed_events")+`
			(consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome, processed_at)
			VALUES ($1, $2, $3, $4, $5, $6, 'applied', now() - make_interval(secs => $7))`,
			group, e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion, ago.Seconds())
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "invoices")+` (event_id) VALUES ($1)`, e.ID); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "aggregate_versions")+`
			(consumer_group, aggregate_type, aggregate_id, version) VALUES ($1, $2, $3, $4)
			ON CONFLICT (consumer_group, aggregate_type, aggregate_id) DO UPDATE SET version = GREATEST(aggregate_versions.version, excluded.version)`,
			group, e.AggregateType, e.AggregateID, e.AggregateVersion)
		return err
	}))
}

// publishVersions publishes n events of aggregate order/id, one
// transaction each (versions 1..n).
func publishVersions(t *testing.T, env pgtest.Env, topic, id string, n int) []eventline.Event {
	t.Helper()
	var out []eventline.Event
	for range n {
		out = append(out, publish(t, env, topic, id)...)
	}
	for i := range out {
		out[i].AggregateVersion = int64(i + 1)
	}
	return out
}

func createInvoices(t *testing.T, env pgtest.Env) string {
	t.Helper()
	table := sqlident.Qualify(env.Schema, "invoices")
	_, err := env.Pool.Exec(context.Background(), `CREATE TABLE `+table+` (seq bigserial PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(t, err)
	return "billing=SELECT event_id, seq FROM " + table
}

func TestVerify(t *testing.T) {
	t.Parallel()

	// A pipeline of the real producer (PublishTx), relay (NewRelay) and
	// consumer (consumer.New) keeps its promises: verify prints its summary,
	// no finding, and exits 0.
	t.Run("a clean pipeline exits 0", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 2, MaxConns: 16}, 3)
		group := kafkatest.Topic(t, "billing")
		invoices := sqlident.Qualify(env.Schema, "invoices")
		orders := sqlident.Qualify(env.Schema, "orders")
		for _, ddl := range []string{
			`CREATE TABLE ` + invoices + ` (seq bigserial PRIMARY KEY, event_id text NOT NULL)`,
			`CREATE TABLE ` + orders + ` (id text PRIMARY KEY, status text NOT NULL)`,
		} {
			_, err := env.Pool.Exec(ctx, ddl)
			require.NoError(t, err)
		}

		prod, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: topic})
		require.NoError(t, err)
		const orderCount, updates = 5, 2
		for i := range orderCount {
			id := "o-" + string(rune('a'+i))
			for u := range updates {
				require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
					status := []string{"created", "paid"}[u]
					if _, err := tx.Exec(ctx, `INSERT INTO `+orders+` (id, status) VALUES ($1, $2)
						ON CONFLICT (id) DO UPDATE SET status = excluded.status`, id, status); err != nil {
						return err
					}
					e, err := eventline.NewJSONEvent("order."+status, "order", id, map[string]string{"id": id})
					if err != nil {
						return err
					}
					return prod.PublishTx(ctx, tx, e)
				}))
			}
		}

		relay, err := producer.NewRelay(ctx, env.Pool, producer.RelayConfig{
			Schema: env.Schema, Brokers: brokers, PollInterval: 200 * time.Millisecond, RebalanceInterval: 100 * time.Millisecond,
		})
		require.NoError(t, err)
		stopRelay := relaytest.Background(t, relay.Run)
		c, err := consumer.New(env.Pool, consumer.Config{Config: middleware.Config{Group: group, Schema: env.Schema}, Brokers: brokers, Topics: []string{topic}})
		require.NoError(t, err)
		for _, typ := range []string{"order.created", "order.paid"} {
			require.NoError(t, c.Handle(typ, func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
				_, err := tx.Exec(ctx, `INSERT INTO `+invoices+` (event_id) VALUES ($1)`, e.ID)
				return err
			}))
		}
		stopConsumer := relaytest.Background(t, c.Run)
		require.Eventually(t, func() bool {
			return pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+invoices) == orderCount*updates
		}, time.Minute, 20*time.Millisecond)
		// The consumer commits its Kafka offsets every second; verify reads
		// them to know the group's topics.
		require.Eventually(t, func() bool {
			r := verifyRun(t, env.Schema, "-brokers", strings.Join(brokers, ","), "-json")
			var v verifyJSON
			return r.code == 0 && jsonUnmarshal(r.stdout, &v) == nil && len(v.Groups) == 1 && v.Groups[0].TopicsFrom == "kafka"
		}, time.Minute, 200*time.Millisecond)
		stopConsumer()
		stopRelay()

		args := []string{"-brokers", strings.Join(brokers, ","), "-effects-query", group + "=SELECT event_id, seq FROM " + invoices}
		r := verifyRun(t, env.Schema, args...)
		require.Equal(t, exitOK, r.code, r.stderr)
		require.Empty(t, r.stderr)
		out := r.stdout
		require.Contains(t, out, "Outbox: 2 shards, 10 events, 10 relayed, 0 pending, 0 retrying, 0 dead letters not replayed")
		require.Contains(t, out, "Kafka: read to the high watermark: "+topic+" (3 partitions, 10 records, 0 duplicates)\n")
		require.Regexp(t, `GROUP\s+TOPICS\s+EVENTS\s+APPLIED\s+PENDING\s+STUCK\s+LOST\s+DISCARDED\s+TWICE\s+OUT OF ORDER\s+PARKED\s+SKIPPED\s+DEAD LETTERS\s+LATE`, out)
		require.Regexp(t, `(?m)^`+group+`\s+`+topic+`\s+10\s+10\s+0\s+0\s+0\s+0\s+0\s+0\s+0\s+0\s+0\s+0$`, out)
		require.NotContains(t, out, "Findings:")
		require.True(t, strings.HasSuffix(out, "\nOK: no problems found.\n"), out)

		v := okJSON[verifyJSON](t, env.Schema, append([]string{"verify", "-json"}, args...)...)
		require.True(t, v.OK)
		require.Zero(t, v.Problems)
		require.Empty(t, v.Findings)
		require.True(t, v.Kafka.Checked)
		require.Len(t, v.Groups, 1)
		require.Equal(t, map[string]int64{"applied": 10}, v.Groups[0].Outcomes)
		require.NotNil(t, v.Groups[0].AppliedTwice)
		require.Zero(t, *v.Groups[0].AppliedTwice)
	})

	// A database broken by hand in every way verify knows: each defect is in
	// the text and in the JSON, and verify exits 3.
	t.Run("a broken database exits 3", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		env := pgtest.New(t, pgtest.Options{Shards: 2})
		effects := createInvoices(t, env)
		const topic = "orders"
		lost := publishVersions(t, env, topic, "o-lost", 3)
		ooo := publishVersions(t, env, topic, "o-order", 3)
		dead := publishVersions(t, env, topic, "o-dead", 1)
		twice := publishVersions(t, env, topic, "o-twice", 1)
		markRelayed(t, env)
		stuck := publishVersions(t, env, topic, "o-stuck", 1)
		_, err := env.Pool.Exec(ctx, `UPDATE `+sqlident.Qualify(env.Schema, outbox.Table(outbox.ShardFor("order", "o-stuck", env.Shards)))+`
			SET created_at = created_at - interval '1 hour' WHERE payload->>'uuid' = $1`, stuck[0].ID)
		require.NoError(t, err)

		recordApplied(t, env, "billing", lost[0], 5*time.Minute)
		recordApplied(t, env, "billing", lost[2], 4*time.Minute) // no record of v2
		recordApplied(t, env, "billing", ooo[0], 3*time.Minute)
		recordApplied(t, env, "billing", ooo[2], 2*time.Minute) // v3 before v2
		recordApplied(t, env, "billing", ooo[1], time.Minute)
		recordApplied(t, env, "billing", twice[0], time.Minute)
		_, err = env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "invoices")+` (event_id) VALUES ($1)`, twice[0].ID)
		require.NoError(t, err)
		_, err = env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "held_events")+`
			(kind, shard, message_uuid, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, topic, attempts, last_error, cause, reason,
			 payload, header_keys, header_values)
			SELECT 'relay_dead_letter', $1, convert_to(uuid::text, 'UTF8'), $2, 'order.updated', 'order', 'o-dead', 1, 'orders', 5, 'kafka: message too large',
				'retries_exhausted', 'gave up after 5 attempts', convert_to(payload::text, 'UTF8'), '{}', '{}'
			FROM `+sqlident.Qualify(env.Schema, outbox.Table(outbox.ShardFor("order", "o-dead", env.Shards)))+` WHERE payload->>'uuid' = $2`,
			outbox.ShardFor("order", "o-dead", env.Shards), dead[0].ID)
		require.NoError(t, err)
		// Group shipping parked thing/x v3 behind a missing v2, and gave up on
		// thing/y v1..v2.
		parkGap(t, env, "billing", "x", 1, 3)
		_, err = env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "skipped_versions")+`
			(consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason) VALUES ('billing', 'thing', 'y', 1, 2, 'park timeout: test')`)
		require.NoError(t, err)

		args := []string{"-group-topics", "billing=orders", "-effects-query", effects}
		r := verifyRun(t, env.Schema, args...)
		require.Equal(t, exitProblems, r.code)
		require.Equal(t, "eventline verify: found 5 problems; see the report above\n", r.stderr)
		out := r.stdout
		require.Contains(t, out, "Outbox: 2 shards, 9 events, 8 relayed, 1 pending (oldest 1h), 0 retrying, 1 dead letter not replayed")
		require.Contains(t, out, "Kafka: not read")
		require.Regexp(t, `(?m)^billing\s+orders\s+9\s+6\s+1\s+1\s+1\s+0\s+1\s+1\s+1\s+1\s+0\s+0$`, out)
		for _, want := range []string{
			"PROBLEM  lost  group billing  order/o-lost v2  event " + lost[1].ID,
			"relayed, but the group's version of order/o-lost is 3, it has no dedup record of this event, and no skipped range covers v2",
			"PROBLEM  applied_twice  group billing  order/o-twice v1  event " + twice[0].ID,
			"PROBLEM  out_of_order  group billing  order/o-order v2  event " + ooo[1].ID,
			"v2 was applied after v3",
			"PROBLEM  dead_letter  relay  order/o-dead v1  event " + dead[0].ID,
			"replay it with `eventline held replay 1`",
			"PROBLEM  pending  group billing  order/o-stuck v1  event " + stuck[0].ID,
			"committed, not relayed yet (stuck: pending for longer than 5m)",
			"WARNING  skipped  group billing  thing/y v1..v2",
			"versions given up on: park timeout: test",
			"INFO     parked  group billing  thing/x v3",
			"parked: the aggregate is at v1 and waits for v2",
		} {
			require.Contains(t, out, want)
		}
		require.True(t, strings.HasSuffix(out, "\nFAILED: 5 problems, 1 warning.\n"), out)

		r = verifyRun(t, env.Schema, append([]string{"-json"}, args...)...)
		require.Equal(t, exitProblems, r.code)
		var v verifyJSON
		require.NoError(t, jsonUnmarshal(r.stdout, &v))
		require.False(t, v.OK)
		require.EqualValues(t, 5, v.Problems)
		require.EqualValues(t, 1, v.Warnings)
		kinds := map[string]int{}
		for _, f := range v.Findings {
			kinds[f.Severity+" "+f.Kind]++
		}
		require.Equal(t, map[string]int{
			"problem lost": 1, "problem applied_twice": 1, "problem out_of_order": 1, "problem dead_letter": 1,
			"problem pending": 1, "warning skipped": 1, "info parked": 1,
		}, kinds)
		g := v.Groups[0]
		require.Equal(t, "config", g.TopicsFrom)
		require.EqualValues(t, 1, g.Lost)
		require.EqualValues(t, 1, g.Stuck)
		require.EqualValues(t, 1, *g.AppliedTwice)
	})

	// Warnings (a skipped gap) fail only a -strict run.
	t.Run("-strict fails on warnings", func(t *testing.T) {
		t.Parallel()
		env := pgtest.New(t, pgtest.Options{Shards: 1})
		_, err := env.Pool.Exec(context.Background(), `INSERT INTO `+sqlident.Qualify(env.Schema, "skipped_versions")+`
			(consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason) VALUES ('billing', 'order', 'o-1', 2, 2, 'released by operator: lost for good')`)
		require.NoError(t, err)
		_, err = env.Pool.Exec(context.Background(), `INSERT INTO `+sqlident.Qualify(env.Schema, "aggregate_versions")+`
			(consumer_group, aggregate_type, aggregate_id, version) VALUES ('billing', 'order', 'o-1', 3)`)
		require.NoError(t, err)
		r := verifyRun(t, env.Schema)
		require.Equal(t, exitOK, r.code, r.stderr)
		require.Contains(t, r.stdout, "OK: no problems, 1 warning.")
		r = verifyRun(t, env.Schema, "-strict")
		require.Equal(t, exitProblems, r.code)
		require.Equal(t, "eventline verify: found 1 warning (failing, -strict); see the report above\n", r.stderr)
		// -since after the skip: nothing to say.
		r = verifyRun(t, env.Schema, "-strict", "-since", time.Now().Add(time.Minute).Format(time.RFC3339))
		require.Equal(t, exitOK, r.code, r.stderr)
	})

	// -consumer-database-url reads the consumer tables from another database
	// (here another schema reached by its own pool).
	t.Run("a separate consumer database", func(t *testing.T) {
		t.Parallel()
		env := pgtest.New(t, pgtest.Options{Shards: 1})
		cons := pgtest.New(t, pgtest.Options{Shards: 1})
		events := publishVersions(t, env, "orders", "o-1", 2)
		markRelayed(t, env)
		_, err := cons.Pool.Exec(context.Background(), `CREATE TABLE `+sqlident.Qualify(cons.Schema, "invoices")+` (seq bigserial PRIMARY KEY, event_id text NOT NULL)`)
		require.NoError(t, err)
		recordApplied(t, cons, "billing", events[1], time.Minute) // v1 lost
		v := verifyJSONOf(t, verifyRun(t, env.Schema, "-json", "-consumer-database-url", pgtest.URL(), "-consumer-schema", cons.Schema), exitProblems)
		require.True(t, v.Separate)
		require.Len(t, v.Findings, 1)
		require.Equal(t, "lost", v.Findings[0].Kind)
		require.Equal(t, events[0].ID, v.Findings[0].EventID)
	})

	t.Run("usage errors", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			args []string
			want string
		}{
			{[]string{"verify", "extra"}, `verify takes no arguments, got ["extra"]`},
			{[]string{"verify", "-since", "yesterday"}, `"yesterday" is neither a duration ago`},
			{[]string{"verify", "-since", "1h", "-until", "2h"}, "-since"},
			{[]string{"verify", "-group-topics", "billing"}, `want GROUP=VALUE, got "billing"`},
			{[]string{"verify", "-effects-query", "billing=x", "-effects-query", "billing=y"}, `group "billing" given twice`},
			{[]string{"verify", "-max-pending", "0s"}, "-max-pending, -max-parked and -dedup-retention must be positive"},
			{[]string{"verify", "-consumer-schema", "bad-name"}, "-consumer-schema"},
			{[]string{"verify", "-brokers", "nohostport"}, `broker "nohostport" is not host:port`},
		} {
			r := cli(t, tc.args...)
			require.Equal(t, exitUsage, r.code, "%v: %s", tc.args, r.stderr)
			require.Contains(t, r.stderr, tc.want)
			require.Contains(t, r.stderr, "Run 'eventline verify -h' for usage.")
		}
		r := cli(t, "verify", "-h")
		require.Equal(t, exitOK, r.code)
		require.Contains(t, r.stdout, "Exit codes: 0 nothing wrong, 3 a problem found")
		require.Contains(t, r.stdout, "-max-pending duration")
	})
}

func verifyJSONOf(t *testing.T, r result, code int) verifyJSON {
	t.Helper()
	require.Equal(t, code, r.code, r.stderr)
	var v verifyJSON
	require.NoError(t, jsonUnmarshal(r.stdout, &v), r.stdout)
	return v
}
