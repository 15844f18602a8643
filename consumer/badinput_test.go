package consumer_test

import (
	"context"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

func badInputConfig(schema string) consumer.Config {
	return consumer.Config{Config: middleware.Config{Group: "g", Schema: schema, Logger: quietLogger()}, Brokers: []string{"127.0.0.1:9"}, Topics: []string{"things"}}
}

// TestNewRefusesRetrySettingsRunWouldRefuse: a NaN or infinite retry
// Multiplier and a NaN Jitter passed New's checks (NaN compares false),
// and then the retries refused every message: each was left
// unacknowledged and redelivered forever. New refuses them, naming the
// field.
func TestNewRefusesRetrySettingsRunWouldRefuse(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	for field, mutate := range map[string]func(*consumer.Config){
		"consumer.Config.Retry.Multiplier is NaN":  func(c *consumer.Config) { c.Retry.Multiplier = math.NaN() },
		"consumer.Config.Retry.Multiplier is +Inf": func(c *consumer.Config) { c.Retry.Multiplier = math.Inf(1) },
		"consumer.Config.Retry.Jitter is NaN":      func(c *consumer.Config) { c.Retry.Jitter = math.NaN() },
	} {
		cfg := badInputConfig(env.Schema)
		mutate(&cfg)
		_, err := consumer.New(env.Pool, cfg)
		require.ErrorContains(t, err, field)
	}
}

// TestRetryInitialIntervalAloneIsEnough: a first retry wait (Retry.Initial)
// above the default cap (10s) with Retry.Max left 0 used to fail with
// "RetryMaxInterval (10s) is below RetryInitialInterval", about a field the
// caller never set; the cap defaults to at least the first wait, as
// eventline.Backoff.Or does for every schedule.
func TestRetryInitialIntervalAloneIsEnough(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	cfg := badInputConfig(env.Schema)
	cfg.Retry.Initial = 20 * time.Second
	_, err := consumer.New(env.Pool, cfg)
	require.NoError(t, err)

	cfg.Retry.Max = 15 * time.Second // set, and below: still refused
	_, err = consumer.New(env.Pool, cfg)
	require.ErrorContains(t, err, "consumer.Config.Retry.Max (15s) is below Initial (20s)")
}

// TestNewRefusesAGroupPostgreSQLCannotStore: the group is written with
// every dedup record, version and dead letter; a NUL byte or invalid
// UTF-8 in it made every event fail in PostgreSQL at run time, and a blank
// group passed as a name.
func TestNewRefusesAGroupPostgreSQLCannotStore(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	for _, group := range []string{"billing\x00", "billing-\xff", "  ", "\t"} {
		cfg := badInputConfig(env.Schema)
		cfg.Group = group
		_, err := consumer.New(env.Pool, cfg)
		require.ErrorContains(t, err, "consumer.Config.Group", "%q", group)
	}
	cfg := badInputConfig(env.Schema)
	cfg.Group = "billing-é.v2"
	_, err := consumer.New(env.Pool, cfg)
	require.NoError(t, err)
}

// TestHandleAndIgnoreRefuseBlankTypesAndIgnoreIsAllOrNothing: an event
// type that is only spaces can never arrive (the producer refuses it), so
// registering it is a mistake; and an Ignore call that fails on one type
// ignores none, so the caller can fix the call and repeat it.
func TestHandleAndIgnoreRefuseBlankTypesAndIgnoreIsAllOrNothing(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	c, err := consumer.New(env.Pool, badInputConfig(env.Schema))
	require.NoError(t, err)
	h := func(context.Context, pgx.Tx, eventline.Event) error { return nil }

	require.ErrorContains(t, c.Handle(" ", h), "event type is empty")
	require.ErrorContains(t, consumer.HandleJSON(c, "\t", func(context.Context, pgx.Tx, eventline.Event, struct{}) error { return nil }),
		"event type is empty")
	require.ErrorContains(t, c.Ignore("  "), "event type is empty")

	require.NoError(t, c.Handle("thing.changed", h))
	require.ErrorContains(t, c.Ignore("thing.noted", ""), "event type is empty")
	require.ErrorContains(t, c.Ignore("thing.seen", "thing.changed"), `consumer.Ignore("thing.changed"): the event type has a handler`)
	// Neither failed call ignored its valid types: they can still get
	// handlers, and the corrected call succeeds.
	require.NoError(t, c.Handle("thing.noted", h))
	require.NoError(t, c.Ignore("thing.seen"))
}

// TestNewConfigProperty draws consumer configurations with zero,
// negative, tiny and huge durations and counts, NaN and infinite floats
// and odd names. New never panics and never starts anything, and either
// accepts the configuration or names, in its error, the field that is
// wrong (New reports the first one).
func TestNewConfigProperty(t *testing.T) {
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	durations := []time.Duration{0, -1, -2, math.MinInt64, 1, time.Millisecond, time.Second, 20 * time.Second, time.Hour, math.MaxInt64}
	floats := []float64{0, -1, 0.5, 1, 2, 1e300, math.Inf(1), math.Inf(-1), math.NaN()}
	rapid.Check(t, func(rt *rapid.T) {
		cfg := badInputConfig(env.Schema)
		fields := map[string]bool{} // fields the draw set to something other than their zero value
		drawDur := func(name string, d *time.Duration) func() {
			return func() {
				*d = rapid.SampledFrom(durations).Draw(rt, name)
				fields[name] = *d != 0
			}
		}
		drawFloat := func(name string, f *float64) func() {
			return func() {
				*f = rapid.SampledFrom(floats).Draw(rt, name)
				fields[name] = *f != 0
			}
		}
		drawInt := func(name string, v *int, vals []int) func() {
			return func() {
				*v = rapid.SampledFrom(vals).Draw(rt, name)
				fields[name] = *v != 0
			}
		}
		perturb := []func(){
			drawDur("Retry.Initial", &cfg.Retry.Initial),
			drawDur("Retry.Max", &cfg.Retry.Max),
			drawDur("InfraBackoff.Initial", &cfg.InfraBackoff.Initial),
			drawDur("InfraBackoff.Max", &cfg.InfraBackoff.Max),
			drawDur("TxTimeout", &cfg.TxTimeout),
			drawDur("ShutdownTimeout", &cfg.ShutdownTimeout),
			drawDur("BatchLinger", &cfg.BatchLinger),
			drawDur("ParkTimeout", &cfg.ParkTimeout),
			drawDur("SweepInterval", &cfg.SweepInterval),
			drawFloat("Retry.Multiplier", &cfg.Retry.Multiplier),
			drawFloat("Retry.Jitter", &cfg.Retry.Jitter),
			drawInt("MaxRetries", &cfg.MaxRetries, []int{0, middleware.NoRetries, -2, 3, math.MaxInt, math.MinInt}),
			drawInt("Lanes", &cfg.Lanes, []int{0, -1, 1, consumer.MaxLanes, consumer.MaxLanes + 1, math.MaxInt}),
			drawInt("BatchSize", &cfg.BatchSize, []int{0, -1, 1, consumer.MaxBatchSize, consumer.MaxBatchSize + 1, math.MaxInt}),
			drawInt("MaxReleaseAttempts", &cfg.MaxReleaseAttempts, []int{0, -1, 1, math.MaxInt}),
			func() {
				cfg.MaxGap = rapid.SampledFrom([]int64{0, -1, 1, math.MaxInt64, math.MinInt64}).Draw(rt, "MaxGap")
				fields["MaxGap"] = cfg.MaxGap != 0
			},
			func() {
				cfg.Group = rapid.SampledFrom([]string{"", " ", "g\x00", "\xff", strings.Repeat("g", 10_000), "g'; drop table x; --"}).Draw(rt, "Group")
				fields["Group"] = true
			},
			func() {
				cfg.Topics = rapid.SampledFrom([][]string{nil, {""}, {"things", "things"}, {"a b"}, {strings.Repeat("t", 250)}}).Draw(rt, "Topics")
				fields["Topics"] = true
			},
			func() {
				cfg.Schema = rapid.SampledFrom([]string{`x"; drop schema public; --`, "pg_x", strings.Repeat("s", 64)}).Draw(rt, "Schema")
				fields["Schema"] = true
			},
			func() {
				cfg.Brokers = rapid.SampledFrom([][]string{{""}, {"nohostport"}, {"127.0.0.1:9", " "}}).Draw(rt, "Brokers")
				fields["Brokers"] = true
			},
		}
		// A few fields at a time, so a bad value is not hidden behind
		// another field New reports first.
		for _, i := range rapid.SliceOfNDistinct(rapid.IntRange(0, len(perturb)-1), 1, 3, rapid.ID[int]).Draw(rt, "fields") {
			perturb[i]()
		}

		// Values no run can use: New must refuse them.
		unusable := math.IsNaN(cfg.Retry.Multiplier) || math.IsInf(cfg.Retry.Multiplier, 0) || cfg.Retry.Multiplier < 0 ||
			math.IsNaN(cfg.Retry.Jitter) || math.IsInf(cfg.Retry.Jitter, 0) || cfg.Retry.Jitter > 1 ||
			fields["Group"] && cfg.Group != strings.Repeat("g", 10_000) && cfg.Group != "g'; drop table x; --" ||
			fields["Topics"] || // nil, empty, listed twice, a space, longer than Kafka allows
			fields["Schema"] || fields["Brokers"]

		c, err := consumer.New(env.Pool, cfg)
		if err == nil {
			require.False(rt, unusable, "New accepted a configuration no run can use")
			require.NotNil(rt, c)
			return
		}
		msg := err.Error()
		named := false
		for field, set := range fields {
			if set && (strings.Contains(msg, "Config."+field) || strings.Contains(msg, "."+field+" ")) {
				named = true
			}
		}
		require.True(rt, named, "the error names none of the fields the draw set: %v", err)
	})
}

// TestNewValidatesTheSaramaConfig: a SaramaConfig Sarama refuses passed
// New and failed only when Run created its Kafka subscriber.
func TestNewValidatesTheSaramaConfig(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	cfg := badInputConfig(env.Schema)
	cfg.SaramaConfig = sarama.NewConfig()
	cfg.SaramaConfig.Net.MaxOpenRequests = 0
	_, err := consumer.New(env.Pool, cfg)
	require.ErrorContains(t, err, "consumer.Config.SaramaConfig: kafka: invalid configuration (Net.MaxOpenRequests must be > 0)")

	cfg.SaramaConfig = sarama.NewConfig()
	_, err = consumer.New(env.Pool, cfg)
	require.NoError(t, err)
}
