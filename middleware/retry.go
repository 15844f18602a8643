package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/tracing"
)

// retry retries a failing attempt of the rest of the chain on Config's
// schedule, each kind of failure its own way (see the package
// documentation, "Three kinds of failure"); an unsafe composition waits
// like an outage, until the chain is fixed. After the last retry of a
// handler's failure the error is returned as a *retriesExhaustedError.
// Each retry it schedules is an "eventline.retry" event on the process
// span (see the package documentation's "Tracing").
//
// Every attempt starts from the context the message arrived with, so each
// gets a fresh consumer transaction. When that context ends (shutdown) a
// wait is cut short and the last error returned; the dead letters then
// leave the message unacknowledged, to be redelivered, instead of
// dead-lettering it.
func (el *Eventline) retry(h message.HandlerFunc) message.HandlerFunc {
	cfg := &el.cfg
	o := &outage{cfg: cfg}
	return func(msg *message.Message) ([]*message.Message, error) {
		orig := msg.Context()
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
				d = backoff.Jittered(cfg.InfraBackoff, waits)
				kind = tracing.RetryKindUnsafeComposition
			case IsInfrastructure(err):
				waits++
				if !waiting {
					waiting = true
					o.enter(orig, err)
				}
				d = backoff.Jittered(cfg.InfraBackoff, waits)
				kind = tracing.RetryKindInfrastructure
				cfg.Metrics.add(infraWaitsCounter, 1, cfg.Group)
				cfg.Logger.DebugContext(orig, "eventline: waiting for the database; the event is not dead-lettered",
					"group", cfg.Group, "message_uuid", msg.UUID, "wait", d, "error", err)
			case IsConflict(err):
				conflicts++
				d = backoff.Jittered(cfg.Retry, conflicts)
				kind = tracing.RetryKindConflict
				cfg.Metrics.add(retriesCounter, 1, cfg.Group, "conflict")
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
					return nil, &retriesExhaustedError{attempts: retries, err: err}
				}
				d = backoff.Jittered(cfg.Retry, retries)
				kind = tracing.RetryKindHandler
				cfg.Metrics.add(retriesCounter, 1, cfg.Group, "handler")
				cfg.Logger.DebugContext(orig, "eventline: handler failed; retrying",
					"group", cfg.Group, "message_uuid", msg.UUID, "retry", retries, "max_retries", cfg.MaxRetries, "wait", d, "error", err)
			}
			tracing.RetryEvent(orig, attempts, kind, d, err)
			if backoff.Sleep(orig, d) != nil {
				return nil, err
			}
		}
	}
}

// retriesExhaustedError is retry's error when the handler still fails
// after the last retry. It is not permanent; the dead letters record it
// with the kind "retries_exhausted".
type retriesExhaustedError struct {
	attempts int // 1 + MaxRetries
	err      error
}

func (e *retriesExhaustedError) Error() string {
	return fmt.Sprintf("eventline: gave up after %d attempts: %v", e.attempts, e.err)
}

func (e *retriesExhaustedError) Unwrap() error { return e.err }

// outage tracks the messages of one handler that wait for the database,
// so an outage logs one line when it starts and one when it ends.
type outage struct {
	cfg *Config

	mu      sync.Mutex
	waiting int
	since   time.Time
}

func (o *outage) enter(ctx context.Context, err error) {
	o.cfg.Metrics.addWaitingOnDatabase(o.cfg.Group, 1)
	o.mu.Lock()
	defer o.mu.Unlock()
	o.waiting++
	if o.waiting == 1 {
		o.since = time.Now()
		o.cfg.Logger.WarnContext(ctx, "eventline: database unavailable; events wait and are retried until it answers, none is dead-lettered",
			"group", o.cfg.Group, "error", err)
	}
}

func (o *outage) leave(ctx context.Context, recovered bool) {
	o.cfg.Metrics.addWaitingOnDatabase(o.cfg.Group, -1)
	o.mu.Lock()
	defer o.mu.Unlock()
	o.waiting--
	if o.waiting == 0 && recovered {
		o.cfg.Logger.InfoContext(ctx, "eventline: database available again; resumed", "group", o.cfg.Group, "outage", time.Since(o.since).Round(time.Millisecond))
	}
}
