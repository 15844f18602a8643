package middleware_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/migrations"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// sarama's metrics registry starts a process-wide meter ticker.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

const group = "billing"

// quiet is a logger for tests: EVENTLINE_TEST_LOG=1 shows debug output.
func quiet() *slog.Logger {
	if os.Getenv("EVENTLINE_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// fixture is a composed middleware around the business handler, with hooks
// to make the handler fail.
type fixture struct {
	env      consumertest.Env
	el       *middleware.Eventline
	metrics  *middleware.Metrics
	registry *prometheus.Registry
	handler  message.HandlerFunc
	calls    atomic.Int64
	// fail, when set, is consulted before the handler writes anything;
	// panicAfterWrite makes the handler panic after writing its effect.
	fail            func(eventline.Event) error
	panicAfterWrite func(eventline.Event) bool
	// observe, when set, sees every call (with its context) first.
	observe func(context.Context, eventline.Event)
}

func newFixture(t *testing.T, cfg middleware.Config) *fixture {
	t.Helper()
	f := &fixture{env: consumertest.New(t, pgtest.Options{MaxConns: 4})}
	var err error
	f.registry = prometheus.NewRegistry()
	f.metrics, err = middleware.NewMetrics(f.registry)
	require.NoError(t, err)
	cfg.Schema = f.env.Schema
	if cfg.Group == "" {
		cfg.Group = group
	}
	if cfg.Logger == nil {
		cfg.Logger = quiet()
	}
	cfg.Metrics = f.metrics
	f.el, err = middleware.New(f.env.Pool, cfg)
	require.NoError(t, err)
	f.handler = f.el.MiddlewareFor("test")(f.business(cfg.Group))
	return f
}

// business is the user's handler: it writes through the consumer tx.
func (f *fixture) business(group string) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		f.calls.Add(1)
		ctx := msg.Context()
		tx, ok := middleware.TxFromContext(ctx)
		if !ok {
			return nil, errors.New("no tx")
		}
		e, ok := middleware.EventFromContext(ctx)
		if !ok {
			return nil, errors.New("no event")
		}
		if f.observe != nil {
			f.observe(ctx, e)
		}
		if f.fail != nil {
			if err := f.fail(e); err != nil {
				return nil, err
			}
		}
		if err := f.env.Apply(ctx, tx, group, e); err != nil {
			return nil, err
		}
		if f.panicAfterWrite != nil && f.panicAfterWrite(e) {
			panic("handler exploded after writing")
		}
		return nil, nil
	}
}

func (f *fixture) deliver(t *testing.T, msg *message.Message) error {
	t.Helper()
	_, err := f.handler(consumertest.Redeliver(msg))
	return err
}

func (f *fixture) versions(t *testing.T, aggregateID string) []int64 {
	t.Helper()
	var out []int64
	for _, e := range f.env.Effects(t, group) {
		if e.AggregateID == aggregateID {
			out = append(out, e.Version)
		}
	}
	return out
}

func (f *fixture) outcome(t *testing.T, eventID string) dedup.Outcome {
	t.Helper()
	r, err := f.el.Store().FindProcessed(context.Background(), f.env.Pool, group, eventID)
	require.NoError(t, err)
	require.Len(t, r, 1, "one record of event %s", eventID)
	return r[0].Outcome
}

func (f *fixture) count(t *testing.T, table string) int {
	t.Helper()
	return f.env.Count(t, table, "")
}

func TestRedeliveredEventIsAppliedOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	msg := consumertest.Message(t, consumertest.Event("a", 1))
	for i := 0; i < 3; i++ {
		require.NoError(t, f.deliver(t, msg))
	}
	require.Len(t, f.env.Effects(t, group), 1, "a redelivered event must not be applied twice")
	require.EqualValues(t, 1, f.calls.Load(), "the handler must not even run for a duplicate")
	require.Equal(t, dedup.OutcomeApplied, f.outcome(t, msg.UUID))
	require.Equal(t, 2.0, f.metric(t, "eventline_consumer_events_duplicate_total"))
}

func TestHandlerErrorLeavesNoDedupRow(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	boom := errors.New("downstream unavailable")
	f.fail = func(eventline.Event) error { return boom }
	msg := consumertest.Message(t, consumertest.Event("a", 1))

	err := f.deliver(t, msg)
	require.ErrorIs(t, err, boom)
	require.False(t, middleware.IsPermanent(err), "a handler error must be retried")
	require.Equal(t, 0, f.count(t, "processed_events"), "a failed handler must leave no dedup row behind")
	require.Equal(t, 0, f.count(t, "aggregate_versions"), "nor a version row")

	f.fail = nil
	require.NoError(t, f.deliver(t, msg))
	require.Equal(t, []int64{1}, f.versions(t, "a"), "the redelivery is applied normally")
}

func TestHandlerPanicIsRolledBack(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	f.panicAfterWrite = func(eventline.Event) bool { return true }
	msg := consumertest.Message(t, consumertest.Event("a", 1))

	err := f.deliver(t, msg)
	_, panicked := middleware.PanicValue(err)
	require.True(t, panicked, "%v", err)
	require.False(t, middleware.IsPermanent(err), "a panic is retried")
	require.Empty(t, f.env.Effects(t, group), "the effect written before the panic must be rolled back")
	require.Equal(t, 0, f.count(t, "processed_events"))

	f.panicAfterWrite = nil
	require.NoError(t, f.deliver(t, msg))
	require.Equal(t, []int64{1}, f.versions(t, "a"))
}

func TestStaleEventIsDiscarded(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 1))))
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 2))))
	// Another event with an old version (e.g. a redelivery whose dedup row
	// expired: same version, new id as far as dedup knows).
	old := consumertest.Message(t, consumertest.Event("a", 1))
	require.NoError(t, f.deliver(t, old))
	require.Equal(t, []int64{1, 2}, f.versions(t, "a"))
	require.Equal(t, dedup.OutcomeStale, f.outcome(t, old.UUID))
	require.Equal(t, 1.0, f.metric(t, "eventline_consumer_events_stale_total"))
}

func TestGapIsParkedAndDrainedInOrder(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	msgs := map[int64]*message.Message{}
	for v := int64(1); v <= 5; v++ {
		msgs[v] = consumertest.Message(t, consumertest.Event("a", v))
	}
	for _, v := range []int64{1, 4, 3, 5} {
		require.NoError(t, f.deliver(t, msgs[v]))
	}
	require.Equal(t, []int64{1}, f.versions(t, "a"))
	require.Equal(t, 3, f.count(t, "parked_events"))
	require.Equal(t, dedup.OutcomeParked, f.outcome(t, msgs[4].UUID))
	// A redelivery of a parked event is a duplicate, not a second parking.
	require.NoError(t, f.deliver(t, msgs[4]))
	require.Equal(t, 3, f.count(t, "parked_events"))

	require.NoError(t, f.deliver(t, msgs[2]))
	require.Equal(t, []int64{1, 2, 3, 4, 5}, f.versions(t, "a"), "parked successors are drained in order with the missing version")
	require.Equal(t, 0, f.count(t, "parked_events"))
	for v := int64(1); v <= 5; v++ {
		require.Equal(t, dedup.OutcomeApplied, f.outcome(t, msgs[v].UUID), "v%d", v)
	}
	value, last := f.env.State(t, group, "thing", "a")
	require.EqualValues(t, 5, last)
	require.Equal(t, fold(1, 2, 3, 4, 5), value)
	require.Equal(t, 3.0, f.metric(t, "eventline_consumer_parked_released_total"))
}

func TestFailedDrainStopsAndTheSweeperRetries(t *testing.T) {
	t.Parallel()
	// No release backoff: the sweeper may retry on its next pass.
	f := newFixture(t, middleware.Config{ParkTimeout: time.Hour, ReleaseBackoff: eventline.Backoff{Initial: time.Nanosecond}})
	var failV3 atomic.Bool
	failV3.Store(true)
	f.fail = func(e eventline.Event) error {
		if e.AggregateVersion == 3 && failV3.Load() {
			return errors.New("v3 cannot be applied yet")
		}
		return nil
	}
	m := map[int64]*message.Message{}
	for v := int64(1); v <= 4; v++ {
		m[v] = consumertest.Message(t, consumertest.Event("a", v))
	}
	require.NoError(t, f.deliver(t, m[1]))
	require.NoError(t, f.deliver(t, m[3]))
	require.NoError(t, f.deliver(t, m[4]))
	require.NoError(t, f.deliver(t, m[2]), "v2 itself commits even though draining v3 fails")
	require.Equal(t, []int64{1, 2}, f.versions(t, "a"))

	parked, err := f.el.Store().ListParked(context.Background(), f.env.Pool, store.ParkedFilter{Group: group})
	require.NoError(t, err)
	require.Len(t, parked, 2)
	require.EqualValues(t, 3, parked[0].Version)
	require.Equal(t, 1, parked[0].ReleaseAttempts)
	require.Contains(t, parked[0].LastError, "v3 cannot be applied yet")
	require.False(t, parked[0].LastAttemptAt.IsZero())
	require.Equal(t, 0, parked[1].ReleaseAttempts, "draining stopped at the failure")

	// The sweeper retries the ready event (no timeout needed).
	res, err := f.el.SweepResult(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, res.Failed)
	failV3.Store(false)
	res, err = f.el.SweepResult(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, res.Released)
	require.Zero(t, res.GapsSkipped)
	require.EqualValues(t, 0, res.Parked)
	require.Equal(t, []int64{1, 2, 3, 4}, f.versions(t, "a"))
	require.Equal(t, 0.0, f.metric(t, "eventline_consumer_parked_events"))
}

func TestSweeperSkipsGapsAfterParkTimeout(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{ParkTimeout: time.Nanosecond})
	for _, v := range []int64{1, 3, 5, 6} {
		require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", v))))
	}
	require.Equal(t, []int64{1}, f.versions(t, "a"))
	res, err := f.el.SweepResult(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, res.GapsSkipped)
	require.EqualValues(t, 2, res.VersionsSkipped)
	require.Equal(t, 3, res.Released)
	require.Equal(t, []int64{1, 3, 5, 6}, f.versions(t, "a"))

	skipped, err := f.el.Store().ListSkipped(context.Background(), f.env.Pool, store.SkippedFilter{Group: group})
	require.NoError(t, err)
	require.Len(t, skipped, 2)
	require.Equal(t, [2]int64{2, 2}, [2]int64{skipped[0].From, skipped[0].To})
	require.Equal(t, [2]int64{4, 4}, [2]int64{skipped[1].From, skipped[1].To})
	require.Contains(t, skipped[0].Reason, "park timeout")

	// The skipped version arriving late is held for the operator (see
	// late_test.go), not applied out of order.
	late := consumertest.Message(t, consumertest.Event("a", 2))
	require.NoError(t, f.deliver(t, late))
	require.Equal(t, dedup.OutcomeLate, f.outcome(t, late.UUID))
	require.Equal(t, []int64{1, 3, 5, 6}, f.versions(t, "a"))
}

func TestSweeperWaitsForParkTimeout(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{ParkTimeout: time.Hour})
	for _, v := range []int64{1, 3} {
		require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", v))))
	}
	res, err := f.el.SweepResult(context.Background())
	require.NoError(t, err)
	require.Zero(t, res.GapsSkipped)
	require.EqualValues(t, 1, res.Parked)
	require.Equal(t, []int64{1}, f.versions(t, "a"))
}

func TestReleaseGapThenSweeperApplies(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{ParkTimeout: time.Hour})
	for _, v := range []int64{1, 4, 5, 7} {
		require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", v))))
	}
	ctx := context.Background()
	rel, err := f.el.Store().ReleaseGap(ctx, f.env.Pool, group, "thing", "a", "v2 and v3 were lost upstream")
	require.NoError(t, err)
	require.EqualValues(t, 2, rel.From)
	require.EqualValues(t, 3, rel.To)
	require.Equal(t, 2, rel.Ready)
	require.Equal(t, []int64{1}, f.versions(t, "a"), "ReleaseGap runs no handler")

	res, err := f.el.SweepResult(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, res.Released)
	require.Zero(t, res.GapsSkipped, "the gap before v7 has not timed out")
	require.Equal(t, []int64{1, 4, 5}, f.versions(t, "a"))

	skipped, err := f.el.Store().ListSkipped(ctx, f.env.Pool, store.SkippedFilter{Group: group, AggregateID: "a"})
	require.NoError(t, err)
	require.Len(t, skipped, 1)
	require.Contains(t, skipped[0].Reason, "released by operator: v2 and v3 were lost upstream")

	_, err = f.el.Store().ReleaseGap(ctx, f.env.Pool, group, "thing", "nope", "x")
	require.ErrorIs(t, err, store.ErrNothingParked)
	_, err = f.el.Store().ReleaseGap(ctx, f.env.Pool, group, "thing", "a", " ")
	require.ErrorContains(t, err, "reason is empty")
}

func fold(versions ...int64) int64 {
	var v int64
	for _, x := range versions {
		v = consumertest.Fold(v, x)
	}
	return v
}

// metric sums a metric family's series (counters and gauges).
func (f *fixture) metric(t *testing.T, name string) float64 {
	t.Helper()
	return metrictest.Sum(t, f.registry, name)
}

// A record that carries a genuine event's id for another aggregate, and
// arrives first, is a different event of its own aggregate, gated on its
// own version: both are applied, one at a time and in one batch. Within
// one aggregate the id still conflicts: a second event under a recorded id
// is refused. Before: the genuine event was refused as an id conflict
// (dead-lettered), and every later version of its aggregate parked behind
// it.
func TestAnIDReusedByAnotherAggregateCostsTheGenuineEventNothing(t *testing.T) {
	t.Parallel()
	for _, batched := range []bool{false, true} {
		name := map[bool]string{false: "one at a time", true: "in a batch"}[batched]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, middleware.Config{})
			a1, a2 := consumertest.Event("a", 1), consumertest.Event("a", 2)
			reused := consumertest.Event("h", 1)
			reused.ID = a1.ID
			msgs := []*message.Message{consumertest.Message(t, reused), consumertest.Message(t, a1), consumertest.Message(t, a2)}
			var errs []error
			if batched {
				errs = deliverBatch(f.handler, msgs...)
			} else {
				for _, m := range msgs {
					errs = append(errs, f.deliver(t, m))
				}
			}
			for i, err := range errs {
				require.NoError(t, err, "message %d", i)
			}
			require.Equal(t, []int64{1}, f.versions(t, "h"), "the reused id is an event of h")
			require.Equal(t, []int64{1, 2}, f.versions(t, "a"), "the genuine event and its successor")
			require.Zero(t, f.metric(t, "eventline_consumer_events_refused_total"))

			sameAggregate := consumertest.Event("a", 3)
			sameAggregate.ID = a2.ID
			err := f.deliver(t, consumertest.Message(t, sameAggregate))
			require.ErrorIs(t, err, dedup.ErrIDConflict, "within one aggregate the id still conflicts")
			require.Equal(t, []int64{1, 2}, f.versions(t, "a"))
		})
	}
}

// A consumer schema whose dedup records are keyed by event id alone (a
// pre-release eventline's, before 007_dedup_scope) is not migrated: the
// middleware would deduplicate by the old key.
func TestCheckMigratedWantsDedupRecordsKeyedByAggregate(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	cfg := migrations.Config{Schema: env.Schema}
	el, err := middleware.New(env.Pool, middleware.Config{Group: "g", Schema: env.Schema, Logger: quiet()})
	require.NoError(t, err)
	require.NoError(t, el.CheckMigrated(ctx))
	rekey := func(key string) {
		_, err := env.Pool.Exec(ctx, `ALTER TABLE `+sqlident.Qualify(cfg.Schema, "processed_events")+` DROP CONSTRAINT processed_events_pkey, ADD PRIMARY KEY (`+key+`)`)
		require.NoError(t, err)
	}
	rekey("consumer_group, event_id")
	err = el.CheckMigrated(ctx)
	require.ErrorIs(t, err, middleware.ErrNotMigrated)
	require.ErrorContains(t, err, "007_dedup_scope")
	rekey("consumer_group, event_id, aggregate_type, aggregate_id")
	require.NoError(t, el.CheckMigrated(ctx))
}
