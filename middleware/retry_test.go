package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/tracing/tracingtest"
	"github.com/eventline/eventline/middleware"
)

// clock records the waits a Retry asks for instead of waiting.
type clock struct {
	mu    sync.Mutex
	waits []time.Duration
	// onWait, when set, runs at each wait (to cancel a context…).
	onWait func(n int)
}

func (c *clock) sleep(ctx context.Context, d time.Duration) error {
	c.mu.Lock()
	c.waits = append(c.waits, d)
	n := len(c.waits)
	c.mu.Unlock()
	if c.onWait != nil {
		c.onWait(n)
	}
	return ctx.Err()
}

func (c *clock) recorded() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Duration(nil), c.waits...)
}

// script is a handler that fails with errs in turn, then succeeds.
type script struct {
	errs     []error
	attempts int
}

func (s *script) handle(*message.Message) ([]*message.Message, error) {
	s.attempts++
	if s.attempts <= len(s.errs) {
		return nil, s.errs[s.attempts-1]
	}
	return nil, nil
}

func repeat(err error, n int) []error {
	out := make([]error, n)
	for i := range out {
		out[i] = err
	}
	return out
}

func ms(xs ...int) []time.Duration {
	out := make([]time.Duration, len(xs))
	for i, x := range xs {
		out[i] = time.Duration(x) * time.Millisecond
	}
	return out
}

var (
	errHandler  = errors.New("smtp down")
	errDBDown   = &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}
	errConflict = &pgconn.PgError{Code: "40001", Message: "could not serialize access"}
)

// retrying runs h behind the retries of a middleware configured with cfg
// (the group "g", a quiet logger and no jitter unless cfg says otherwise),
// its waits recorded by c instead of waited, on a message with ctx.
func retrying(t *testing.T, ctx context.Context, cfg middleware.Config, c *clock, h message.HandlerFunc) error {
	t.Helper()
	if cfg.Group == "" {
		cfg.Group = "g"
	}
	if cfg.Logger == nil {
		cfg.Logger = quiet()
	}
	if cfg.Retry.Jitter == 0 {
		cfg.Retry.Jitter = middleware.NoJitter
	}
	retry, err := middleware.Retry(cfg)
	require.NoError(t, err)
	msg := message.NewMessage("m", nil)
	msg.SetContext(backoff.WithSleep(ctx, c.sleep))
	_, err = retry(h)(msg)
	return err
}

// Watermill's Retry advanced its backoff twice per attempt (0.2/0.8/3.2 s
// for a configured 100 ms doubling). eventline's waits exactly the
// documented min(Initial × Multiplier^(n−1), Max).
func TestRetryWaitsTheDocumentedSchedule(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cfg  middleware.Config
		want []time.Duration
	}{
		{"defaults", middleware.Config{}, ms(100, 200, 400, 800, 1600)},
		{"capped", middleware.Config{MaxRetries: 4, Retry: eventline.Backoff{Initial: time.Second, Multiplier: 3, Max: 5 * time.Second}},
			ms(1000, 3000, 5000, 5000)},
		{"constant", middleware.Config{MaxRetries: 3, Retry: eventline.Backoff{Initial: 50 * time.Millisecond, Multiplier: 1}}, ms(50, 50, 50)},
		{"no retries", middleware.Config{MaxRetries: middleware.NoRetries}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &clock{}
			s := &script{errs: repeat(errHandler, 100)}
			err := retrying(t, context.Background(), tc.cfg, c, s.handle)
			attempts, exhausted := middleware.ExhaustedAttempts(err)
			require.True(t, exhausted, "%v", err)
			require.ErrorIs(t, err, errHandler)
			require.Equal(t, len(tc.want)+1, s.attempts, "one attempt plus MaxRetries retries")
			require.Equal(t, s.attempts, attempts)
			require.Equal(t, tc.want, c.recorded())
		})
	}
}

func TestRetryWaitsForTheDatabaseWithoutSpendingTheBudget(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	metrics, err := middleware.NewMetrics(reg)
	require.NoError(t, err)
	c := &clock{}
	var waiting []float64
	c.onWait = func(int) { waiting = append(waiting, metrictest.Sum(t, reg, "eventline_consumer_waiting_on_database")) }
	// Seven failures because the database is down (far more than the
	// budget of two), then two handler failures, then success.
	s := &script{errs: append(repeat(errDBDown, 7), errHandler, errHandler)}
	err = retrying(t, context.Background(), middleware.Config{MaxRetries: 2, Metrics: metrics}, c, s.handle)
	require.NoError(t, err, "an outage longer than the retry budget must not exhaust it")
	require.Equal(t, 10, s.attempts)
	require.Equal(t, append(ms(250, 500, 1000, 2000, 4000, 5000, 5000), ms(100, 200)...), c.recorded(),
		"outage waits double from InfraBackoff.Initial up to its Max; the handler's retries then start at Retry.Initial")
	require.Equal(t, 7.0, metrictest.Sum(t, reg, "eventline_consumer_infra_waits_total"))
	require.Equal(t, 2.0, metrictest.Sum(t, reg, "eventline_consumer_retries_total"))
	require.Equal(t, []float64{1, 1, 1, 1, 1, 1, 1, 0, 0}, waiting, "waiting_on_database is 1 during the outage, 0 after")
	require.Zero(t, metrictest.Sum(t, reg, "eventline_consumer_waiting_on_database"))

	// The same outage with no retry budget at all.
	c = &clock{}
	s = &script{errs: repeat(fmt.Errorf("begin: %w: connection refused", middleware.ErrInfrastructure), 20)}
	err = retrying(t, context.Background(), middleware.Config{MaxRetries: middleware.NoRetries}, c, s.handle)
	require.NoError(t, err)
	require.Equal(t, 21, s.attempts)
	require.Equal(t, ms(250, 500, 1000), c.recorded()[:3], "the outage's schedule, whatever the budget")
}

func TestRetryDoesNotRetryPermanentErrorsAndRetriesConflictsForFree(t *testing.T) {
	t.Parallel()
	c := &clock{}
	perm := middleware.Permanent(errors.New("payload does not decode"))
	s := &script{errs: []error{perm}}
	err := retrying(t, context.Background(), middleware.Config{}, c, s.handle)
	require.Same(t, perm, err, "a permanent error is returned as is")
	require.Equal(t, 1, s.attempts)
	require.Empty(t, c.recorded())

	c = &clock{}
	s = &script{errs: repeat(errConflict, 4)}
	err = retrying(t, context.Background(), middleware.Config{MaxRetries: middleware.NoRetries}, c, s.handle)
	require.NoError(t, err, "serialization failures do not spend the budget")
	require.Equal(t, ms(100, 200, 400, 800), c.recorded(), "they are retried on the normal schedule")
}

func TestRetryStopsWaitingWhenTheMessageContextEnds(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	c := &clock{onWait: func(n int) {
		if n == 3 {
			cancel() // shutdown begins during the third wait
		}
	}}
	s := &script{errs: repeat(errDBDown, 100)}
	retry, err := middleware.Retry(middleware.Config{Group: "g", Logger: quiet()})
	require.NoError(t, err)
	msg := message.NewMessage("m", nil)
	ctx = backoff.WithSleep(ctx, c.sleep)
	msg.SetContext(ctx)
	_, err = retry(s.handle)(msg)
	require.ErrorIs(t, err, errDBDown, "the last error is returned, so the message is left unacknowledged")
	require.Equal(t, 3, s.attempts)
	require.Same(t, ctx, msg.Context(), "the message context is restored")
}

func TestRetryJitterStaysWithinItsBounds(t *testing.T) {
	t.Parallel()
	c := &clock{}
	s := &script{errs: repeat(errHandler, 100)}
	_ = retrying(t, context.Background(), middleware.Config{MaxRetries: 50, Retry: eventline.Backoff{Initial: time.Second, Multiplier: 1, Jitter: 0.25}}, c, s.handle)
	waits := c.recorded()
	require.Len(t, waits, 50)
	distinct := map[time.Duration]bool{}
	for _, w := range waits {
		require.GreaterOrEqual(t, w, 750*time.Millisecond)
		require.LessOrEqual(t, w, 1250*time.Millisecond)
		distinct[w] = true
	}
	require.Greater(t, len(distinct), 1, "jitter spreads the waits")

	// The default jitter spreads the default schedule by ±20%.
	c = &clock{}
	s = &script{errs: repeat(errHandler, 100)}
	retry, err := middleware.Retry(middleware.Config{Group: "g", MaxRetries: 1, Logger: quiet()})
	require.NoError(t, err)
	msg := message.NewMessage("m", nil)
	msg.SetContext(backoff.WithSleep(context.Background(), c.sleep))
	_, _ = retry(s.handle)(msg)
	require.Len(t, c.recorded(), 1)
	require.InDelta(t, float64(100*time.Millisecond), float64(c.recorded()[0]), float64(20*time.Millisecond))
}

// Settings no schedule can follow are refused by New, naming the field,
// before any event is handled.
func TestRetryRefusesInvalidSettings(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  middleware.Config
		want string
	}{
		{middleware.Config{Retry: eventline.Backoff{Multiplier: 0.5}}, "middleware.Config.Retry.Multiplier"},
		{middleware.Config{MaxRetries: -7}, "middleware.Config.MaxRetries"},
		{middleware.Config{Retry: eventline.Backoff{Jitter: 2}}, "middleware.Config.Retry.Jitter"},
		{middleware.Config{Retry: eventline.Backoff{Initial: time.Second, Max: time.Millisecond}}, "middleware.Config.Retry.Max"},
	} {
		tc.cfg.Group = "g"
		_, err := middleware.Retry(tc.cfg)
		require.ErrorContains(t, err, tc.want, "%+v", tc.cfg)
	}
	_, err := middleware.Retry(middleware.Config{Group: "g"})
	require.NoError(t, err)
}

// TestRetriesAreSpanEvents: every retry the chain schedules (a handler
// failure, a conflict, a wait for the database) is an "eventline.retry"
// event on the span of the message's context, with the attempt that
// failed, the kind, the wait and the error, cut to 1 KiB of valid UTF-8;
// the attempt that succeeds and a permanent failure add none.
func TestRetriesAreSpanEvents(t *testing.T) {
	t.Parallel()
	rec := tracingtest.New(t)
	c := &clock{}
	hostile := errors.New(strings.Repeat("\xffé", 100_000))
	s := &script{errs: []error{errHandler, errConflict, errDBDown, hostile, middleware.Permanent(errors.New("cannot apply"))}}
	ctx, span := rec.Provider.Tracer("t").Start(context.Background(), "process orders")
	err := retrying(t, ctx, middleware.Config{}, c, s.handle)
	require.ErrorContains(t, err, "cannot apply")
	span.End()

	evs := rec.Spans()[0].Events
	require.Len(t, evs, 4, "one event per retry, none for the permanent failure")
	want := []struct{ attempt, kind, wait, err string }{
		{"1", "handler", "0.1", errHandler.Error()},
		{"2", "conflict", "0.1", errConflict.Error()},
		{"3", "infrastructure", "0.25", errDBDown.Error()},
		{"4", "handler", "0.2", ""},
	}
	for i, w := range want {
		require.Equal(t, "eventline.retry", evs[i].Name)
		got := map[string]string{}
		for _, kv := range evs[i].Attributes {
			got[string(kv.Key)] = kv.Value.Emit()
		}
		require.Equal(t, w.attempt, got["eventline.retry.attempt"], "event %d", i)
		require.Equal(t, w.kind, got["eventline.retry.kind"], "event %d", i)
		require.Equal(t, w.wait, got["eventline.retry.wait.seconds"], "event %d", i)
		if w.err != "" {
			require.Equal(t, w.err, got["eventline.retry.error"], "event %d", i)
		} else {
			require.True(t, strings.HasSuffix(got["eventline.retry.error"], "…"), "the hostile error is cut")
		}
		require.LessOrEqual(t, len(got["eventline.retry.error"]), 1024, "event %d", i)
		require.True(t, utf8.ValidString(got["eventline.retry.error"]), "event %d", i)
	}
}
