package middleware

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/configerr"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/versioning"
)

// Defaults and special values of [Config].
const (
	// DefaultTxTimeout is the default Config.TxTimeout.
	DefaultTxTimeout = time.Minute
	// NoTxTimeout, as Config.TxTimeout, leaves transactions unbounded: a
	// frozen connection then blocks its partition until TCP gives up on it.
	NoTxTimeout = time.Duration(-1)
	// DefaultMaxRetries is how many times a failing event is retried
	// before it is dead-lettered.
	DefaultMaxRetries = 5
	// NoRetries, as Config.MaxRetries, dead-letters a failing event after
	// its first attempt.
	NoRetries = -1
	// NoJitter, as Config.Retry.Jitter, waits exactly the retry schedule
	// (a zero Jitter takes DefaultRetry's).
	NoJitter = -1.0
)

// Default schedules of [Config].
var (
	// DefaultRetry is the wait before each retry of a failing event: 100ms,
	// 200ms, 400ms, 800ms, 1.6s… up to 10s, each spread at random by ±20%.
	DefaultRetry = eventline.Backoff{Initial: 100 * time.Millisecond, Max: 10 * time.Second, Multiplier: 2, Jitter: 0.2}
	// DefaultInfraBackoff is the wait while the database is unavailable:
	// 250ms, doubling up to 5s, so work resumes within 5s of its return.
	DefaultInfraBackoff = eventline.Backoff{Initial: 250 * time.Millisecond, Max: 5 * time.Second, Multiplier: 2}
)

// Config configures the middleware returned by [New]. Only Group is
// required. The consumer package's Config embeds it: every field here
// means the same in the ready runner.
type Config struct {
	// Group is the consumer group: dedup records, versions, parked events
	// and dead letters are kept per group. Required; it is stored with
	// every record, so it must be valid UTF-8 without NUL bytes.
	Group string
	// Schema is the PostgreSQL schema holding eventline's tables (see
	// package migrations). Defaults to "eventline".
	Schema string
	// GapPolicy is what happens to an event that arrives ahead of a
	// missing version of its aggregate. Defaults to versioning.Park.
	GapPolicy versioning.GapPolicy
	// PolicyByType overrides GapPolicy per event type.
	PolicyByType map[string]versioning.GapPolicy
	// LatePolicy is what happens to a late event, one whose version was
	// given up on before it arrived: held for the operator (`eventline
	// held list -kind late`), or applied at once with IsLate. Defaults to
	// versioning.HoldLate.
	LatePolicy versioning.LatePolicy
	// LatePolicyByType overrides LatePolicy per event type.
	LatePolicyByType map[string]versioning.LatePolicy
	// MaxGap bounds the versions one event that follows v-1 may leave
	// missing in front of it (see package versioning, "The gate"); an
	// event beyond it (an inflated version) is refused as permanent and
	// dead-lettered. Defaults to versioning.DefaultMaxGap (1000).
	MaxGap int64
	// Unversioned is what happens to an event without an aggregate
	// version. Defaults to versioning.PassUnversioned.
	Unversioned versioning.UnversionedPolicy
	// Validate, when set, checks, without applying it, that an event could
	// be applied (its payload decodes for its handler…). The gate calls it
	// before it parks an event or holds it as late; an error refuses the
	// event as permanent (dead-lettered at once, with the error as the
	// reason) instead of letting it wait and fail when its turn comes.
	Validate func(ctx context.Context, e eventline.Event) error
	// Upcasters, when set, brings each event's payload to the current
	// schema version of its type just before its handler runs: inside the
	// transaction, after the gate, so parked events, late events and
	// replayed dead letters are upcast when they run, and what is parked or
	// dead-lettered keeps the payload as published. An event at a version
	// the upcasters cannot reach is permanent: dead-lettered, also when it
	// arrives out of order (the gate checks it before it parks or is held).
	Upcasters *eventline.Upcasters
	// ParkTimeout is how long an aggregate's parked events wait for the
	// missing versions before the sweeper skips the gap. Defaults to
	// versioning.DefaultParkTimeout (1 hour).
	ParkTimeout time.Duration
	// SweepInterval is the pause between sweeper passes (and dead-letter
	// replay passes) in Run. Defaults to versioning.DefaultSweepInterval
	// (5s).
	SweepInterval time.Duration
	// SweepBatch is the most aggregates one sweeper pass visits. Defaults
	// to versioning.DefaultSweepBatch (500).
	SweepBatch int
	// MaxReleaseAttempts is how many failed attempts to apply a parked
	// event are allowed before it is given up: held as late (held_events)
	// for the operator, its version recorded as skipped. Defaults to
	// versioning.DefaultMaxReleaseAttempts (10).
	MaxReleaseAttempts int
	// ReleaseBackoff is the wait between failed attempts to apply a
	// parked event. Zero fields take versioning.DefaultReleaseBackoff's
	// (5s, doubling up to 5m).
	ReleaseBackoff eventline.Backoff
	// MaxRetries is how many times a failing event is retried, each
	// attempt in a new transaction, before it is dead-lettered (see the
	// package documentation, "Three kinds of failure", for the errors that
	// do not spend it). Defaults to DefaultMaxRetries (5); NoRetries
	// dead-letters after the first failure.
	MaxRetries int
	// Retry is the wait before each retry: retry n waits
	// min(Initial × Multiplier^(n−1), Max), spread by Jitter. Zero fields
	// take DefaultRetry's (100ms doubling up to 10s, jitter 0.2); NoJitter
	// as Jitter waits exactly the schedule.
	Retry eventline.Backoff
	// InfraBackoff is the wait while the database is unavailable (refused,
	// reset, restarting, not answering within TxTimeout): events wait for
	// as long as the outage lasts, never dead-lettered, and so do
	// dead-letter writes and a consumer starting up. Zero fields take
	// DefaultInfraBackoff's (250ms doubling up to 5s).
	InfraBackoff eventline.Backoff
	// TxTimeout bounds one event's transaction: BEGIN, the handler and
	// COMMIT. It is how a connection that stops answering without closing
	// (a vanished or frozen database host) is noticed: when it passes, the
	// transaction is abandoned and the database probed (see the package
	// documentation, "Three kinds of failure"). Defaults to
	// DefaultTxTimeout (1m); NoTxTimeout disables it.
	TxTimeout time.Duration
	// TxOptions are the consumer transactions' options. Defaults to read
	// committed, read-write.
	TxOptions pgx.TxOptions
	// Middleware runs around every event added with AddHandler, outside
	// the eventline transaction and inside retries and dead-lettering
	// (logging, tracing of your own…). The first is outermost. The events
	// of one batch (the consumer's lanes) pass it concurrently, each
	// returning once the batch has committed.
	Middleware []message.HandlerMiddleware
	// Logger receives what the middleware and the sweeper report.
	// Defaults to slog.Default().
	Logger *slog.Logger
	// Metrics, when set, counts what happens to events (see NewMetrics).
	Metrics *Metrics
	// TracerProvider, when set, traces each event (see the package
	// documentation, "Tracing"). Defaults to nil: no spans, and no cost
	// beyond a nil check per event.
	TracerProvider trace.TracerProvider
	// Propagator reads the trace context from message metadata. Defaults
	// to OpenTelemetry's global propagator if the application set one
	// (otel.SetTextMapPropagator), else W3C trace context and baggage.
	Propagator propagation.TextMapPropagator
	// MeterProvider, when set, also receives the stage latencies of
	// eventline_consumer_stage_seconds as the OTel histogram
	// eventline.stage.duration. Defaults to nil.
	MeterProvider metric.MeterProvider
}

// withDefaults returns c with every default filled in, or an error naming
// the first invalid field as middleware.Config.<Field> (the consumer names
// it consumer.Config.<Field>: its Config embeds this one). It is the one
// validation of the configuration: what it returns is trusted inside.
func (c Config) withDefaults() (Config, error) {
	const name = "middleware.Config"
	fail := func(format string, args ...any) (Config, error) { return c, configerr.New(name, format, args...) }
	wrap := func(err error) (Config, error) { return c, &configerr.Error{Struct: name, Err: err} }
	if strings.TrimSpace(c.Group) == "" {
		return fail("Group is empty: name the consumer group (dedup records and versions are kept per group)")
	}
	if err := sqlident.Text("Group", c.Group); err != nil {
		return wrap(err)
	}
	if c.Schema == "" {
		c.Schema = migrations.DefaultSchema
	}
	if err := sqlident.Validate("Schema", c.Schema); err != nil {
		return wrap(err)
	}
	if err := validatePolicies("GapPolicy", c.GapPolicy, "PolicyByType", c.PolicyByType, checkGapPolicy); err != nil {
		return wrap(err)
	}
	if err := validatePolicies("LatePolicy", c.LatePolicy, "LatePolicyByType", c.LatePolicyByType, checkLatePolicy); err != nil {
		return wrap(err)
	}
	c.GapPolicy = cmp.Or(c.GapPolicy, versioning.DefaultGapPolicy)
	c.LatePolicy = cmp.Or(c.LatePolicy, versioning.DefaultLatePolicy)
	c.Unversioned = cmp.Or(c.Unversioned, versioning.DefaultUnversionedPolicy)
	if c.Unversioned != versioning.PassUnversioned && c.Unversioned != versioning.RejectUnversioned {
		return fail("Unversioned %q is unknown: use %q or %q", c.Unversioned, versioning.PassUnversioned, versioning.RejectUnversioned)
	}
	c.MaxGap = cmp.Or(c.MaxGap, versioning.DefaultMaxGap)
	c.ParkTimeout = cmp.Or(c.ParkTimeout, versioning.DefaultParkTimeout)
	c.SweepInterval = cmp.Or(c.SweepInterval, versioning.DefaultSweepInterval)
	c.SweepBatch = cmp.Or(c.SweepBatch, versioning.DefaultSweepBatch)
	c.MaxReleaseAttempts = cmp.Or(c.MaxReleaseAttempts, versioning.DefaultMaxReleaseAttempts)
	c.TxTimeout = cmp.Or(c.TxTimeout, DefaultTxTimeout)
	switch {
	case c.MaxGap < 0:
		return fail("MaxGap is %d; it must be positive (0 means %d; math.MaxInt64 disables the bound)", c.MaxGap, versioning.DefaultMaxGap)
	case c.ParkTimeout < 0:
		return fail("ParkTimeout is %s; it must be positive (0 means %s)", c.ParkTimeout, versioning.DefaultParkTimeout)
	case c.SweepInterval < 0:
		return fail("SweepInterval is %s; it must be positive (0 means %s)", c.SweepInterval, versioning.DefaultSweepInterval)
	case c.SweepBatch < 0:
		return fail("SweepBatch is %d; it must be positive (0 means %d)", c.SweepBatch, versioning.DefaultSweepBatch)
	case c.MaxReleaseAttempts < 0:
		return fail("MaxReleaseAttempts is %d; it must be positive (0 means %d)", c.MaxReleaseAttempts, versioning.DefaultMaxReleaseAttempts)
	case c.MaxRetries < 0 && c.MaxRetries != NoRetries:
		return fail("MaxRetries is %d; use a positive count, 0 for %d, or NoRetries", c.MaxRetries, DefaultMaxRetries)
	case c.TxTimeout < 0 && c.TxTimeout != NoTxTimeout:
		return fail("TxTimeout is %s; it must be positive (0 means %s, NoTxTimeout none)", c.TxTimeout, DefaultTxTimeout)
	}
	switch c.MaxRetries {
	case 0:
		c.MaxRetries = DefaultMaxRetries
	case NoRetries:
		c.MaxRetries = 0
	}
	c.Retry = c.Retry.Or(DefaultRetry) // keeps NoJitter, which is not zero
	if c.Retry.Jitter == NoJitter {
		c.Retry.Jitter = 0
	}
	c.InfraBackoff = c.InfraBackoff.Or(DefaultInfraBackoff)
	c.ReleaseBackoff = c.ReleaseBackoff.Or(versioning.DefaultReleaseBackoff)
	for _, b := range []struct {
		name string
		b    eventline.Backoff
	}{{"Retry", c.Retry}, {"InfraBackoff", c.InfraBackoff}, {"ReleaseBackoff", c.ReleaseBackoff}} {
		if err := b.b.Validate(b.name); err != nil {
			return wrap(err)
		}
	}
	for i, m := range c.Middleware {
		if m == nil {
			return fail("Middleware[%d] is nil", i)
		}
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c, nil
}

// validatePolicies checks def, the policy of the field name, when set,
// and every entry of byType, the field byTypeName, with check.
func validatePolicies[P ~string](name string, def P, byTypeName string, byType map[string]P, check func(name string, p P) error) error {
	if def != "" {
		if err := check(name, def); err != nil {
			return err
		}
	}
	for typ, p := range byType {
		if typ == "" {
			return fmt.Errorf("%s has an empty event type", byTypeName)
		}
		if err := check(fmt.Sprintf("%s[%q]", byTypeName, typ), p); err != nil {
			return err
		}
	}
	return nil
}

func checkGapPolicy(name string, p versioning.GapPolicy) error {
	switch p {
	case versioning.Park, versioning.Apply:
		return nil
	case versioning.Reject:
		return fmt.Errorf("%s %q is no longer supported: retrying an early event blocked its partition, so one out-of-order delivery lost the aggregate; use %q (set ParkTimeout to give gaps up sooner)", name, p, versioning.Park)
	}
	return fmt.Errorf("%s %q is unknown: use %q or %q", name, p, versioning.Park, versioning.Apply)
}

func checkLatePolicy(name string, p versioning.LatePolicy) error {
	if p != versioning.HoldLate && p != versioning.ApplyLate {
		return fmt.Errorf("%s %q is unknown: use %q or %q", name, p, versioning.HoldLate, versioning.ApplyLate)
	}
	return nil
}

// policyFor is the policy of byType for an event type, else def (the
// config's, its default filled in).
func policyFor[P ~string](byType map[string]P, eventType string, def P) P {
	if p, ok := byType[eventType]; ok && p != "" {
		return p
	}
	return def
}
