package middleware

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline/internal/tracing"
)

// Defaults for [Retry].
const (
	// DefaultMaxRetries is how many times a failing event is retried
	// before it is given up on (and dead-lettered).
	DefaultMaxRetries = 5
	// DefaultRetryInitialInterval is the wait before the first retry.
	DefaultRetryInitialInterval = 100 * time.Millisecond
	// DefaultRetryMultiplier scales the wait after each retry.
	DefaultRetryMultiplier = 2.0
	// DefaultRetryMaxInterval caps the wait between retries.
	DefaultRetryMaxInterval = 10 * time.Second
	// DefaultInfraInitialInterval is the first wait while the database
	// is unavailable.
	DefaultInfraInitialInterval = 250 * time.Millisecond
	// DefaultInfraMaxInterval caps the wait while the database is
	// unavailable: once it answers again, work resumes within this time.
	DefaultInfraMaxInterval = 5 * time.Second
	// NoRetries, as Retry.MaxRetries, gives up after the first failure.
	NoRetries = -1
)

// Retry retries a failing handler on a documented schedule, telling the
// three kinds of failure apart (see [IsInfrastructure]):
//
//   - a permanent error ([IsPermanent]) is returned at once, not retried;
//   - an infrastructure error (the database is down, restarting, or did
//     not answer) is retried for as long as it lasts, waiting
//     InfraInitialInterval, doubling up to InfraMaxInterval, and never
//     spends the retry budget: a database outage never dead-letters an
//     event;
//   - a transaction conflict ([IsConflict]) is retried on the schedule
//     below without spending the budget;
//   - any other error is the handler's: retry n (n = 1…MaxRetries) waits
//     min(InitialInterval × Multiplier^(n−1), MaxInterval), so the
//     defaults wait 100ms, 200ms, 400ms, 800ms and 1.6s; after the last
//     retry fails the error is returned as a *RetriesExhaustedError.
//
// Every wait is then spread by Jitter: it is drawn uniformly from
// [w × (1−Jitter), w × (1+Jitter)].
//
// Each retry it schedules is visible in traces: when the message's context
// carries a recording span (the process span of [Eventline.Traced], which
// Chain and the consumer runner put outermost), Retry adds to it an
// "eventline.retry" event with the attributes eventline.retry.attempt (the
// attempt that failed, from 1, every kind counted),
// eventline.retry.kind (handler, conflict, infrastructure, or
// unsafe_composition), eventline.retry.wait.seconds (the wait, after
// jitter) and eventline.retry.error (the error, cut to 1 KiB and made
// valid UTF-8). Without a recording span it adds nothing and allocates
// nothing for it.
//
// Every attempt starts from the context the message arrived with, so each
// gets a fresh consumer transaction. When that context ends (shutdown) a
// wait is cut short and the last error returned; [DeadLetter] and the
// consumer runner then leave the message unacknowledged, to be redelivered,
// instead of dead-lettering it.
//
// Put it outside the eventline middleware and inside [DeadLetter]:
//
//	DeadLetter ▸ Retry ▸ eventline ▸ handler
//
// (Eventline.AddHandler and the consumer runner do.) Placed inside a
// consumer transaction it refuses to run, with a *CompositionError. Zero
// fields take the defaults; a Retry with invalid settings fails every
// message with a *CompositionError naming the field, and never drops one.
type Retry struct {
	// MaxRetries is how many times a failing event is retried after its
	// first attempt. Defaults to DefaultMaxRetries (5); NoRetries gives up
	// after the first failure.
	MaxRetries int
	// InitialInterval is the wait before the first retry. Defaults to
	// DefaultRetryInitialInterval (100ms).
	InitialInterval time.Duration
	// Multiplier scales the wait after each retry; at least 1. Defaults to
	// DefaultRetryMultiplier (2).
	Multiplier float64
	// MaxInterval caps the wait between retries. Defaults to
	// DefaultRetryMaxInterval (10s).
	MaxInterval time.Duration
	// Jitter spreads every wait by up to this fraction of it, at random,
	// so consumers that failed together do not retry together; between 0
	// and 1. Defaults to 0: every wait is exactly the schedule's.
	Jitter float64
	// InfraInitialInterval is the first wait while the database is
	// unavailable; waits double from there. Defaults to
	// DefaultInfraInitialInterval (250ms).
	InfraInitialInterval time.Duration
	// InfraMaxInterval caps the waits while the database is unavailable.
	// Defaults to DefaultInfraMaxInterval (5s).
	InfraMaxInterval time.Duration
	// Group labels logs and metrics (the consumer group).
	Group string
	// Logger receives a warning when an outage starts, a line when it
	// ends, and a debug line per retry. Defaults to slog.Default().
	Logger *slog.Logger
	// Metrics, when set, counts retries and waits for the database
	// (retries_total, infra_waits_total, waiting_on_database).
	Metrics *Metrics
	// Sleep waits d or until ctx ends, returning ctx's error then.
	// Defaults to a timer; tests inject their own to check the schedule
	// without waiting.
	Sleep func(ctx context.Context, d time.Duration) error
}

// RetriesExhaustedError is returned by [Retry] when the handler still
// fails after the last retry. It is not permanent; [DeadLetter] records it
// with the kind "retries_exhausted".
type RetriesExhaustedError struct {
	// Attempts is the number of attempts made (1 + MaxRetries).
	Attempts int
	// Err is the last attempt's error.
	Err error
}

// Error implements error.
func (e *RetriesExhaustedError) Error() string {
	return fmt.Sprintf("eventline: gave up after %d attempts: %v", e.Attempts, e.Err)
}

// Unwrap returns the last attempt's error.
func (e *RetriesExhaustedError) Unwrap() error { return e.Err }

// withDefaults fills zero fields and reports invalid ones.
func (r Retry) withDefaults() (Retry, error) {
	switch r.MaxRetries {
	case 0:
		r.MaxRetries = DefaultMaxRetries
	case NoRetries:
		r.MaxRetries = 0
	}
	if r.InitialInterval == 0 {
		r.InitialInterval = DefaultRetryInitialInterval
	}
	if r.Multiplier == 0 {
		r.Multiplier = DefaultRetryMultiplier
	}
	if r.MaxInterval == 0 {
		r.MaxInterval = max(DefaultRetryMaxInterval, r.InitialInterval)
	}
	if r.InfraInitialInterval == 0 {
		r.InfraInitialInterval = DefaultInfraInitialInterval
	}
	if r.InfraMaxInterval == 0 {
		r.InfraMaxInterval = max(DefaultInfraMaxInterval, r.InfraInitialInterval)
	}
	if r.Logger == nil {
		r.Logger = slog.Default()
	}
	if r.Sleep == nil {
		r.Sleep = sleep
	}
	return r, r.validate("middleware.Retry")
}

// validate reports the first invalid field; field prefixes its name.
func (r Retry) validate(field string) error {
	switch {
	case r.MaxRetries < 0:
		return fmt.Errorf("%s.MaxRetries is %d; use a positive count, 0 for %d, or NoRetries", field, r.MaxRetries, DefaultMaxRetries)
	case r.InitialInterval < 0:
		return fmt.Errorf("%s.InitialInterval is %s; it must be positive", field, r.InitialInterval)
	case r.Multiplier < 1 || math.IsNaN(r.Multiplier) || math.IsInf(r.Multiplier, 0):
		return fmt.Errorf("%s.Multiplier is %g; it must be at least 1", field, r.Multiplier)
	case r.MaxInterval < r.InitialInterval:
		return fmt.Errorf("%s.MaxInterval (%s) is below InitialInterval (%s)", field, r.MaxInterval, r.InitialInterval)
	case r.Jitter < 0 || r.Jitter > 1 || math.IsNaN(r.Jitter):
		return fmt.Errorf("%s.Jitter is %g; it must be between 0 and 1", field, r.Jitter)
	case r.InfraInitialInterval < 0:
		return fmt.Errorf("%s.InfraInitialInterval is %s; it must be positive", field, r.InfraInitialInterval)
	case r.InfraMaxInterval < r.InfraInitialInterval:
		return fmt.Errorf("%s.InfraMaxInterval (%s) is below InfraInitialInterval (%s)", field, r.InfraMaxInterval, r.InfraInitialInterval)
	}
	return nil
}

// Validate reports, naming the field, a setting Middleware would refuse.
func (r Retry) Validate() error {
	_, err := r.withDefaults()
	return err
}

// Interval returns the wait before retry n (n ≥ 1) before jitter:
// min(InitialInterval × Multiplier^(n−1), MaxInterval), with the defaults
// applied to zero fields.
func (r Retry) Interval(n int) time.Duration {
	r, _ = r.withDefaults()
	return backoff(r.InitialInterval, r.Multiplier, r.MaxInterval, n)
}

// InfraInterval returns the wait after the n-th consecutive failure of
// an event because the database was unavailable (n ≥ 1), before jitter:
// min(InfraInitialInterval × 2^(n−1), InfraMaxInterval).
func (r Retry) InfraInterval(n int) time.Duration {
	r, _ = r.withDefaults()
	return backoff(r.InfraInitialInterval, 2, r.InfraMaxInterval, n)
}

func backoff(initial time.Duration, mult float64, ceiling time.Duration, n int) time.Duration {
	if n < 1 {
		n = 1
	}
	w := float64(initial) * math.Pow(mult, float64(n-1))
	if w >= float64(ceiling) || math.IsInf(w, 0) || math.IsNaN(w) {
		return ceiling
	}
	return time.Duration(w)
}

func (r Retry) jitter(d time.Duration) time.Duration {
	if r.Jitter == 0 || d <= 0 {
		return d
	}
	return time.Duration(float64(d) * (1 + r.Jitter*(2*rand.Float64()-1)))
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Middleware returns the Retry middleware.
func (r Retry) Middleware(h message.HandlerFunc) message.HandlerFunc {
	cfg, cerr := r.withDefaults()
	if cerr != nil {
		cerr = &CompositionError{Problem: cerr.Error(), Fix: "fix the retry settings"}
	}
	o := &outage{log: cfg.Logger, metrics: cfg.Metrics, group: cfg.Group}
	return func(msg *message.Message) ([]*message.Message, error) {
		if cerr != nil {
			return nil, cerr
		}
		orig := msg.Context()
		if _, ok := TxFromContext(orig); ok {
			return nil, &CompositionError{Problem: "middleware.Retry runs inside a consumer transaction, so every retry would repeat the handler's writes in the same transaction",
				Fix: "put Retry outside the eventline middleware (use Eventline.AddHandler)"}
		}
		var attempts, retries, conflicts, waits int
		waiting := false
		defer func() {
			if waiting {
				o.leave(orig, false)
			}
		}()
		for {
			msg.SetContext(orig)
			attempts++
			out, err := h(msg)
			msg.SetContext(orig)
			if err == nil {
				if waiting {
					waiting = false
					o.leave(orig, true)
				}
				return out, nil
			}
			if orig.Err() != nil {
				return nil, err
			}
			var d time.Duration
			var kind string
			switch {
			case IsPermanent(err):
				return nil, err
			case errors.Is(err, ErrUnsafeComposition):
				// A deployment error: hold the event until the chain is
				// fixed (the eventline middleware logged and counted it).
				waits++
				d = backoff(cfg.InfraInitialInterval, 2, cfg.InfraMaxInterval, waits)
				kind = tracing.RetryKindUnsafeComposition
			case IsInfrastructure(err):
				waits++
				if !waiting {
					waiting = true
					o.enter(orig, err)
				}
				d = backoff(cfg.InfraInitialInterval, 2, cfg.InfraMaxInterval, waits)
				kind = tracing.RetryKindInfrastructure
				cfg.Metrics.incInfraWait(cfg.Group)
				cfg.Logger.DebugContext(orig, "eventline: waiting for the database; the event is not dead-lettered",
					"group", cfg.Group, "message_uuid", msg.UUID, "wait", d, "error", err)
			case IsConflict(err):
				conflicts++
				d = backoff(cfg.InitialInterval, cfg.Multiplier, cfg.MaxInterval, conflicts)
				kind = tracing.RetryKindConflict
				cfg.Metrics.incRetry(cfg.Group, "conflict")
				cfg.Logger.DebugContext(orig, "eventline: transaction conflict; retrying without spending the retry budget",
					"group", cfg.Group, "message_uuid", msg.UUID, "conflicts", conflicts, "wait", d, "error", err)
			default:
				if waiting {
					// The database answered (the handler failed): the
					// outage is over for this event.
					waiting = false
					o.leave(orig, true)
				}
				retries++
				if retries > cfg.MaxRetries {
					return nil, &RetriesExhaustedError{Attempts: retries, Err: err}
				}
				d = backoff(cfg.InitialInterval, cfg.Multiplier, cfg.MaxInterval, retries)
				kind = tracing.RetryKindHandler
				cfg.Metrics.incRetry(cfg.Group, "handler")
				cfg.Logger.DebugContext(orig, "eventline: handler failed; retrying",
					"group", cfg.Group, "message_uuid", msg.UUID, "retry", retries, "max_retries", cfg.MaxRetries, "wait", d, "error", err)
			}
			d = cfg.jitter(d)
			tracing.RetryEvent(orig, attempts, kind, d, err)
			if cfg.Sleep(orig, d) != nil {
				return nil, err
			}
		}
	}
}

// outage tracks the messages of one handler that wait for the database,
// so an outage logs one line when it starts and one when it ends.
type outage struct {
	log     *slog.Logger
	metrics *Metrics
	group   string

	mu      sync.Mutex
	waiting int
	since   time.Time
}

func (o *outage) enter(ctx context.Context, err error) {
	o.metrics.addWaitingOnDatabase(o.group, 1)
	o.mu.Lock()
	defer o.mu.Unlock()
	o.waiting++
	if o.waiting == 1 {
		o.since = time.Now()
		o.log.WarnContext(ctx, "eventline: database unavailable; events wait and are retried until it answers, none is dead-lettered",
			"group", o.group, "error", err)
	}
}

func (o *outage) leave(ctx context.Context, recovered bool) {
	o.metrics.addWaitingOnDatabase(o.group, -1)
	o.mu.Lock()
	defer o.mu.Unlock()
	o.waiting--
	if o.waiting == 0 && recovered {
		o.log.InfoContext(ctx, "eventline: database available again; resumed", "group", o.group, "outage", time.Since(o.since).Round(time.Millisecond))
	}
}
