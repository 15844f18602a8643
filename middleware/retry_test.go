package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/metrictest"
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

// Watermill's Retry advanced its backoff twice per attempt (0.2/0.8/3.2 s
// for a configured 100 ms doubling). eventline's waits exactly the
// documented min(InitialInterval × Multiplier^(n−1), MaxInterval).
func TestRetryWaitsTheDocumentedSchedule(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		retry middleware.Retry
		want  []time.Duration
	}{
		{"defaults", middleware.Retry{}, ms(100, 200, 400, 800, 1600)},
		{"capped", middleware.Retry{MaxRetries: 4, InitialInterval: time.Second, Multiplier: 3, MaxInterval: 5 * time.Second},
			ms(1000, 3000, 5000, 5000)},
		{"constant", middleware.Retry{MaxRetries: 3, InitialInterval: 50 * time.Millisecond, Multiplier: 1}, ms(50, 50, 50)},
		{"no retries", middleware.Retry{MaxRetries: middleware.NoRetries}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &clock{}
			tc.retry.Sleep, tc.retry.Logger = c.sleep, quiet()
			s := &script{errs: repeat(errHandler, 100)}
			_, err := tc.retry.Middleware(s.handle)(message.NewMessage("m", nil))
			var exhausted *middleware.RetriesExhaustedError
			require.ErrorAs(t, err, &exhausted)
			require.ErrorIs(t, err, errHandler)
			require.Equal(t, len(tc.want)+1, s.attempts, "one attempt plus MaxRetries retries")
			require.Equal(t, s.attempts, exhausted.Attempts)
			require.Equal(t, tc.want, c.recorded())
			for i, w := range tc.want {
				require.Equal(t, w, tc.retry.Interval(i+1), "Interval(%d) documents the wait", i+1)
			}
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
	retry := middleware.Retry{MaxRetries: 2, Group: "g", Metrics: metrics, Sleep: c.sleep, Logger: quiet()}
	// Seven failures because the database is down (far more than the
	// budget of two), then two handler failures, then success.
	s := &script{errs: append(repeat(errDBDown, 7), errHandler, errHandler)}
	_, err = retry.Middleware(s.handle)(message.NewMessage("m", nil))
	require.NoError(t, err, "an outage longer than the retry budget must not exhaust it")
	require.Equal(t, 10, s.attempts)
	require.Equal(t, append(ms(250, 500, 1000, 2000, 4000, 5000, 5000), ms(100, 200)...), c.recorded(),
		"outage waits double from InfraInitialInterval up to InfraMaxInterval; the handler's retries then start at InitialInterval")
	require.Equal(t, 7.0, metrictest.Sum(t, reg, "eventline_consumer_infra_waits_total"))
	require.Equal(t, 2.0, metrictest.Sum(t, reg, "eventline_consumer_retries_total"))
	require.Equal(t, []float64{1, 1, 1, 1, 1, 1, 1, 0, 0}, waiting, "waiting_on_database is 1 during the outage, 0 after")
	require.Zero(t, metrictest.Sum(t, reg, "eventline_consumer_waiting_on_database"))

	// The same outage with no retry budget at all.
	c = &clock{}
	s = &script{errs: repeat(&middleware.InfraError{Op: "begin", Err: errors.New("connection refused")}, 20)}
	_, err = middleware.Retry{MaxRetries: middleware.NoRetries, Sleep: c.sleep, Logger: quiet()}.Middleware(s.handle)(message.NewMessage("m", nil))
	require.NoError(t, err)
	require.Equal(t, 21, s.attempts)
}

func TestRetryDoesNotRetryPermanentErrorsAndRetriesConflictsForFree(t *testing.T) {
	t.Parallel()
	c := &clock{}
	perm := middleware.Permanent(errors.New("payload does not decode"))
	s := &script{errs: []error{perm}}
	_, err := middleware.Retry{Sleep: c.sleep, Logger: quiet()}.Middleware(s.handle)(message.NewMessage("m", nil))
	require.Same(t, perm, err, "a permanent error is returned as is")
	require.Equal(t, 1, s.attempts)
	require.Empty(t, c.recorded())

	c = &clock{}
	s = &script{errs: repeat(errConflict, 4)}
	_, err = middleware.Retry{MaxRetries: middleware.NoRetries, Sleep: c.sleep, Logger: quiet()}.Middleware(s.handle)(message.NewMessage("m", nil))
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
	msg := message.NewMessage("m", nil)
	msg.SetContext(ctx)
	_, err := middleware.Retry{Sleep: c.sleep, Logger: quiet()}.Middleware(s.handle)(msg)
	require.ErrorIs(t, err, errDBDown, "the last error is returned, so the message is left unacknowledged")
	require.Equal(t, 3, s.attempts)
	require.Same(t, ctx, msg.Context(), "the message context is restored")
}

func TestRetryJitterStaysWithinItsBounds(t *testing.T) {
	t.Parallel()
	c := &clock{}
	s := &script{errs: repeat(errHandler, 100)}
	_, _ = middleware.Retry{MaxRetries: 50, InitialInterval: time.Second, Multiplier: 1, Jitter: 0.25, Sleep: c.sleep, Logger: quiet()}.
		Middleware(s.handle)(message.NewMessage("m", nil))
	waits := c.recorded()
	require.Len(t, waits, 50)
	distinct := map[time.Duration]bool{}
	for _, w := range waits {
		require.GreaterOrEqual(t, w, 750*time.Millisecond)
		require.LessOrEqual(t, w, 1250*time.Millisecond)
		distinct[w] = true
	}
	require.Greater(t, len(distinct), 1, "jitter spreads the waits")
}

func TestRetryRefusesInvalidSettingsAndTheWrongPlace(t *testing.T) {
	t.Parallel()
	for _, r := range []middleware.Retry{{Multiplier: 0.5}, {MaxRetries: -7}, {Jitter: 2}, {InitialInterval: time.Second, MaxInterval: time.Millisecond}} {
		s := &script{}
		_, err := r.Middleware(s.handle)(message.NewMessage("m", nil))
		require.ErrorIs(t, err, middleware.ErrUnsafeComposition, "%+v", r)
		require.ErrorContains(t, err, "middleware.Retry.")
		require.Zero(t, s.attempts)
		require.Error(t, r.Validate())
	}
	require.NoError(t, middleware.Retry{}.Validate())
}

func ExampleRetry() {
	retry := middleware.Retry{MaxRetries: 4} // the other fields take their defaults
	for n := 1; n <= 4; n++ {
		fmt.Println(retry.Interval(n))
	}
	fmt.Println("outage:", retry.InfraInterval(1), retry.InfraInterval(2), retry.InfraInterval(10))
	// Output:
	// 100ms
	// 200ms
	// 400ms
	// 800ms
	// outage: 250ms 500ms 5s
}
