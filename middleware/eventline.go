package middleware

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/nilcheck"
	"github.com/eventline/eventline/internal/txhooks"
	"github.com/eventline/eventline/versioning"
)

// Pool is the database handle the composed middleware needs: batches that
// begin transactions for events, and queries and transactions for the
// sweeper. *pgxpool.Pool satisfies it.
type Pool interface {
	TxBeginner
	versioning.Pool
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Config configures the composed middleware returned by [New].
type Config struct {
	// DB is the consumer's database pool; every event runs in a
	// transaction on it. Required.
	DB Pool
	// Group is the consumer group: dedup records, versions and parked
	// events are kept per group. Required.
	Group string
	// Schema is the PostgreSQL schema holding eventline's tables (see
	// package migrations). Defaults to "eventline".
	Schema string
	// GapPolicy is what happens to an event that arrives ahead of a
	// missing version. Defaults to versioning.Park.
	GapPolicy versioning.GapPolicy
	// PolicyByType overrides GapPolicy per event type.
	PolicyByType map[string]versioning.GapPolicy
	// LatePolicy is what happens to a late event, one whose version was
	// given up on before it arrived: held for the operator, or applied at
	// once with IsLate. Defaults to versioning.HoldLate.
	LatePolicy versioning.LatePolicy
	// LatePolicyByType overrides LatePolicy per event type.
	LatePolicyByType map[string]versioning.LatePolicy
	// MaxGap bounds the versions one event may leave missing in front of
	// it; an event beyond it is refused as permanent. An event that
	// declares its predecessor (versioning.DeclaresPredecessor) is not
	// bounded: it waits for that one event. Defaults to
	// versioning.DefaultMaxGap (1000).
	MaxGap int64
	// Validate, when set, is called before an event is parked or held as
	// late; an error refuses it as permanent (see ValidateFunc).
	Validate ValidateFunc
	// Upcasters, when set, brings each event's payload to the current
	// schema version of its type before a handler wrapped by Middleware,
	// MiddlewareFor, Chain or AddHandler (or registered with Register)
	// runs: inside the transaction, after the gate, so parked events,
	// late events and replayed dead letters are upcast when they run. An
	// event at a version the upcasters cannot reach is a permanent error,
	// dead-lettered whole by the safe chain. It is the same as wrapping
	// each handler in [Upcast] yourself, plus one check: before an event
	// parks or is held as late, the gate refuses it (dead-lettered, as in
	// order) when the upcasters cannot bring it to the current version,
	// so its successors wait behind it instead of being applied first.
	Upcasters *eventline.Upcasters
	// Unversioned is what happens to an event without an aggregate
	// version. Defaults to versioning.PassUnversioned.
	Unversioned versioning.UnversionedPolicy
	// ParkTimeout is how long an aggregate's parked events wait for the
	// missing versions before the sweeper skips the gap. Defaults to
	// versioning.DefaultParkTimeout (1 hour).
	ParkTimeout time.Duration
	// MaxReleaseAttempts is how many failed attempts to apply a parked
	// event are allowed before it is given up: dead-lettered through
	// DeadLetter, its version recorded as skipped. Defaults to
	// versioning.DefaultMaxReleaseAttempts (10).
	MaxReleaseAttempts int
	// ReleaseBackoff is the wait after a first failed release attempt; it
	// doubles per failure up to MaxReleaseBackoff. Defaults to
	// versioning.DefaultReleaseBackoff (5s) and
	// versioning.DefaultMaxReleaseBackoff (5m).
	ReleaseBackoff    time.Duration
	MaxReleaseBackoff time.Duration // see ReleaseBackoff
	// DeadLetter stores a parked event that was given up (see
	// versioning.DeadLetterFunc). Defaults to holding it as late (held_events),
	// where `eventline held list -kind late` lists it.
	DeadLetter versioning.DeadLetterFunc
	// SweepInterval is the pause between sweeper passes in RunSweeper.
	// Defaults to versioning.DefaultSweepInterval (5s).
	SweepInterval time.Duration
	// SweepBatch is the most aggregates one sweeper pass visits. Defaults
	// to versioning.DefaultSweepBatch (500).
	SweepBatch int
	// TxOptions are the consumer transactions' options. Defaults to read
	// committed, read-write.
	TxOptions pgx.TxOptions
	// TxTimeout bounds one event's transaction: BEGIN, the handler and
	// COMMIT. It is how a connection that stops answering without closing
	// (a vanished or frozen database host) is noticed. When it passes, the
	// transaction is abandoned and the database is probed: if it does not
	// answer, the attempt failed for the infrastructure (the event waits,
	// see IsInfrastructure); if it does, the handler was too slow, which
	// counts against the retry budget. Defaults to DefaultTxTimeout (1m);
	// NoTxTimeout disables it.
	TxTimeout time.Duration
	// Retry is the retry schedule of Chain and AddHandler. Zero fields
	// take the Retry defaults; Group, Logger and Metrics default to this
	// Config's.
	Retry Retry
	// Logger receives what the middleware and sweeper report. Defaults to
	// slog.Default().
	Logger *slog.Logger
	// Metrics, when set, counts what happens to events.
	Metrics *Metrics
	// TracerProvider, when set, traces each event (see Eventline.Traced):
	// a "process <topic>" span per delivery continuing the trace in the
	// record's headers, "release <topic>" spans for parked events applied
	// later and "dead_letter <topic>" spans. Defaults to nil: no spans, and
	// no cost beyond a nil check per event.
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

// sweepTxTimeout is the sweeper's bound per aggregate for the
// middleware's TxTimeout: the same, or the sweeper's default when
// transactions are unbounded.
func sweepTxTimeout(d time.Duration) time.Duration {
	if d <= 0 {
		return versioning.DefaultSweepTxTimeout
	}
	return d
}

// DefaultTxTimeout is the default Config.TxTimeout.
const DefaultTxTimeout = time.Minute

// NoTxTimeout, as Config.TxTimeout, leaves transactions unbounded: a
// frozen connection then blocks its partition until TCP gives up on it.
const NoTxTimeout = time.Duration(-1)

func (c Config) validate() error {
	switch {
	case nilcheck.IsNil(c.DB):
		return errors.New("middleware.Config.DB is nil: give it the consumer's *pgxpool.Pool")
	case c.ParkTimeout < 0:
		return fmt.Errorf("middleware.Config.ParkTimeout is %s; it must be positive (0 means %s)", c.ParkTimeout, versioning.DefaultParkTimeout)
	case c.SweepInterval < 0:
		return fmt.Errorf("middleware.Config.SweepInterval is %s; it must be positive (0 means %s)", c.SweepInterval, versioning.DefaultSweepInterval)
	case c.SweepBatch < 0:
		return fmt.Errorf("middleware.Config.SweepBatch is %d; it must be positive (0 means %d)", c.SweepBatch, versioning.DefaultSweepBatch)
	case c.TxTimeout < 0 && c.TxTimeout != NoTxTimeout:
		return fmt.Errorf("middleware.Config.TxTimeout is %s; it must be positive (0 means %s, NoTxTimeout none)", c.TxTimeout, DefaultTxTimeout)
	}
	if _, err := c.Retry.withDefaults(); err != nil {
		return fmt.Errorf("middleware.Config.Retry: %w", err)
	}
	return nil
}

// Eventline is the composed consumer middleware: recover ▸ tx ▸ decode ▸
// dedup ▸ version gate ▸ handler, plus the sweeper for parked events.
//
// For each message it begins a transaction on Config.DB, decodes the event
// (a message that does not decode fails with a permanent error and never
// reaches the handler), records the event id and locks, checks and advances
// the aggregate's version in one statement, runs the handler with the
// transaction and the event in the message context, drains parked
// successors, and commits before returning, so before the router
// acknowledges. Any error or panic rolls everything back, the dedup record
// included, and is returned for retry. Duplicates and stale events are
// acknowledged without running the handler; parked events are acknowledged
// and applied later, in order; late events are held for the operator (or
// applied at once, marked late, under ApplyLate). Events that can never be
// applied are refused with a permanent error, counted in
// eventline_consumer_events_refused_total and dead-lettered: an event id
// recorded for a different event (id conflict), a version that would leave
// more than MaxGap versions missing, an event that fails Validate or
// whose content cannot be stored when it must be parked or held.
//
// Failures carry their kind (see [IsInfrastructure]): a database that is
// unreachable, did not answer within Config.TxTimeout, or lost the
// connection during COMMIT (the outcome is unknown; the dedup record
// decides on the next attempt) fails the attempt with an *InfraError, so
// [Retry] waits for the database instead of spending its budget.
//
// Use [Eventline.AddHandler] (or [Eventline.Chain]) to put [DeadLetter] and
// [Retry] around it in the only safe order. A poison queue or a retry
// placed inside it is detected and the event refused with a
// *CompositionError, never committed.
type Eventline struct {
	cfg     Config
	gate    *Gate
	sweeper *versioning.Sweeper
	dl      *DeadLetter
	// hookPanic is reportHookPanic, bound once.
	hookPanic txhooks.PanicHandler
}

// New returns the composed middleware. It fails, naming the field, when the
// configuration is invalid.
func New(cfg Config) (*Eventline, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.TxTimeout == 0 {
		cfg.TxTimeout = DefaultTxTimeout
	}
	if cfg.Retry.Group == "" {
		cfg.Retry.Group = cfg.Group
	}
	if cfg.Retry.Logger == nil {
		cfg.Retry.Logger = cfg.Logger
	}
	if cfg.Retry.Metrics == nil {
		cfg.Retry.Metrics = cfg.Metrics
	}
	gate, err := newGate(GateConfig{
		Group: cfg.Group, Schema: cfg.Schema, GapPolicy: cfg.GapPolicy, PolicyByType: cfg.PolicyByType,
		LatePolicy: cfg.LatePolicy, LatePolicyByType: cfg.LatePolicyByType, MaxGap: cfg.MaxGap, Validate: upcastable(cfg.Upcasters, cfg.Validate),
		Unversioned: cfg.Unversioned, MaxReleaseAttempts: cfg.MaxReleaseAttempts, ReleaseBackoff: cfg.ReleaseBackoff,
		MaxReleaseBackoff: cfg.MaxReleaseBackoff, DeadLetter: cfg.DeadLetter, Logger: cfg.Logger, Metrics: cfg.Metrics,
		TracerProvider: cfg.TracerProvider, Propagator: cfg.Propagator, MeterProvider: cfg.MeterProvider,
	}, "middleware.Config")
	if err != nil {
		return nil, err
	}
	sweeper, err := gate.NewSweeper(cfg.DB, versioning.SweeperConfig{
		ParkTimeout: cfg.ParkTimeout, Interval: cfg.SweepInterval, Batch: cfg.SweepBatch, Logger: gate.cfg.Logger,
		TxTimeout: sweepTxTimeout(cfg.TxTimeout),
	})
	if err != nil {
		return nil, err
	}
	dl, err := NewDeadLetter(DeadLetterConfig{
		DB: cfg.DB, Group: cfg.Group, Schema: cfg.Schema,
		InfraInitialInterval: cfg.Retry.InfraInitialInterval, InfraMaxInterval: cfg.Retry.InfraMaxInterval,
		Logger: cfg.Logger, Metrics: cfg.Metrics, Sleep: cfg.Retry.Sleep,
		TracerProvider: cfg.TracerProvider, Propagator: cfg.Propagator,
	})
	if err != nil {
		return nil, fmt.Errorf("middleware.Config: %w", err)
	}
	el := &Eventline{cfg: cfg, gate: gate, sweeper: sweeper, dl: dl}
	el.hookPanic = el.reportHookPanic
	return el, nil
}

// Middleware returns the composed middleware; add it to a Router
// (router.AddMiddleware) or to one handler.
//
// Per event on the hot path it costs three round trips, as a bare handler
// in its own transaction does: BEGIN travels in one batch with the
// statement that records the event id and locks, checks and advances the
// aggregate's version; then the handler's statements; then COMMIT. The
// message is decoded before the transaction begins (the statement needs
// the event), so a malformed message costs no database work.
func (el *Eventline) Middleware(h message.HandlerFunc) message.HandlerFunc {
	inner := el.guard(el.upcasting(h))
	el.gate.reg.wrap(inner)
	return el.handler(inner)
}

// handler is the eventline middleware around inner, without registering
// inner anywhere.
func (el *Eventline) handler(inner message.HandlerFunc) message.HandlerFunc {
	g := el.gate
	return g.obs.traced(el.cfg.Group, Recover(func(msg *message.Message) (out []*message.Message, err error) {
		parent := msg.Context()
		if _, nested := TxFromContext(parent); nested {
			return nil, &CompositionError{Problem: "the eventline middleware runs inside another consumer transaction",
				Fix: "add it once per handler, outside your handler and inside Retry and DeadLetter"}
		}
		e, err := decode(msg)
		if err != nil {
			return nil, err
		}
		if e.Topic == "" {
			e.Topic = SourceFromContext(parent).Topic
		}
		if err := g.precheck(e); err != nil {
			return nil, err
		}
		// AfterCommit hooks registered from here on report their panics
		// to el (RunAfterCommit recovers them).
		hctx := el.withHookReports(parent)
		if s := slotFromContext(parent); s != nil {
			// A member of a Batch: applied with the others (batch.go), or
			// told to run on its own below.
			msg.SetContext(hctx)
			if out, err, alone := s.arrive(el, msg, e, inner); !alone {
				return out, err
			}
		}
		ctx, cancel := hctx, context.CancelFunc(func() {})
		if el.cfg.TxTimeout > 0 {
			ctx, cancel = context.WithTimeout(hctx, el.cfg.TxTimeout)
		}
		defer func() {
			cancel()
			msg.SetContext(parent)
		}()
		tx, a, err := el.begin(ctx, e)
		if err != nil {
			return nil, el.classify(parent, ctx, stageBegin, false, err)
		}
		msg.SetContext(ContextWithEvent(ctx, e))
		lost := false // the transaction's connection died under the handler
		out, err = runInTx(msg, tx, func(msg *message.Message) ([]*message.Message, error) {
			out, err := g.proceed(msg, tx, e, inner, a)
			if err != nil {
				// Read before the rollback hands the connection back.
				lost = tx.Conn() != nil && tx.Conn().IsClosed()
			}
			return out, err
		})
		if err != nil {
			stage := stageHandler
			var ce *commitError
			if errors.As(err, &ce) {
				stage = stageCommit
			}
			if errors.Is(err, ErrUnsafeComposition) {
				holdUnsafe(parent) // rolled back by now: nothing is held but the message
			}
			return nil, el.classify(parent, ctx, stage, lost, err)
		}
		return out, nil
	}))
}

// begin opens the event's transaction and admits the event in the same
// round trip.
func (el *Eventline) begin(ctx context.Context, e eventline.Event) (pgx.Tx, versioning.Admission, error) {
	b := &pgx.Batch{}
	b.BeginTx(el.cfg.TxOptions)
	admission := el.gate.queueAdmission(b, e)
	br := el.cfg.DB.SendBatch(ctx, b)
	tx := br.Tx()
	err := br.Close()
	if tx == nil {
		return nil, versioning.Admission{}, errNoBatchTx
	}
	if err != nil {
		rollback(ctx, tx)
		return nil, versioning.Admission{}, fmt.Errorf("eventline: begin consumer transaction: %w", err)
	}
	a, err := admission(ctx, tx)
	if err != nil {
		rollback(ctx, tx)
		return nil, versioning.Admission{}, el.gate.admissionError(ctx, e, err)
	}
	return tx, a, nil
}

// admissionError turns an admission's error into what the event's chain
// gets: an id conflict is refused (permanent, counted, dead-lettered),
// anything else is returned as is.
func (g *Gate) admissionError(ctx context.Context, e eventline.Event, err error) error {
	if errors.Is(err, dedup.ErrIDConflict) {
		return g.refuse(ctx, e, RefusedIDConflict, err)
	}
	return err
}

var errNoBatchTx = errors.New("eventline: middleware.Config.DB.SendBatch did not begin a transaction (pgx.Batch.BeginTx needs pgx v5.12 or later)")

// queueAdmission queues on b the statement that admits e: it records the
// event id in processed_events and, for a versioned event, locks, checks
// and advances its aggregate's version. The returned function reads the
// admission, through the batch's transaction, once the batch results are
// closed; a duplicate of an unversioned event reads as
// versioning.Duplicate, an applicable unversioned event as the zero
// Admission. Both the one-event path and batches admit through it.
func (g *Gate) queueAdmission(b *pgx.Batch, e eventline.Event) func(ctx context.Context, tx versioning.DBTX) (versioning.Admission, error) {
	if e.AggregateVersion > 0 {
		p := g.store.QueueAdmit(b, g.cfg.Group, e, g.jumps(e), true)
		return p.Result
	}
	p := g.store.Dedup().QueueInsert(b, g.cfg.Group, e, dedup.OutcomeApplied)
	return func(ctx context.Context, tx versioning.DBTX) (versioning.Admission, error) {
		fresh, err := p.Result(ctx, tx)
		if err != nil {
			return versioning.Admission{}, err
		}
		if !fresh {
			return versioning.Admission{Verdict: versioning.Duplicate}, nil
		}
		return versioning.Admission{}, nil
	}
}

// MiddlewareFor is Middleware for one handler, registering it under
// handlerName for the sweeper (see [Gate.Register]).
func (el *Eventline) MiddlewareFor(handlerName string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		wrapped := el.Middleware(h)
		el.gate.Register(handlerName, el.upcasting(h))
		return wrapped
	}
}

// Register tells the sweeper which handler releases events parked under
// the Watermill handler name handlerName; see [Gate.Register]. A nil h is
// ignored.
func (el *Eventline) Register(handlerName string, h message.HandlerFunc) {
	if h == nil {
		return
	}
	el.gate.Register(handlerName, el.upcasting(h))
}

// upcastable is validate preceded by the check that up can bring the
// event to the current schema version of its type: an event it cannot is
// refused before it parks or is held as late, as the handler would refuse
// it in order, so it is dead-lettered and its successors wait behind it
// instead of being applied first. validate still sees the event as
// received. Without upcasters it is validate.
func upcastable(up *eventline.Upcasters, validate ValidateFunc) ValidateFunc {
	if up == nil {
		return validate
	}
	return func(ctx context.Context, e eventline.Event) error {
		if _, err := up.Upcast(e); err != nil {
			return err
		}
		if validate != nil {
			return validate(ctx, e)
		}
		return nil
	}
}

// upcasting is h behind Config.Upcasters, or h itself without them.
func (el *Eventline) upcasting(h message.HandlerFunc) message.HandlerFunc {
	if el.cfg.Upcasters == nil {
		return h
	}
	return Upcast(el.cfg.Upcasters)(h)
}

// Gate returns the version gate inside the middleware.
func (el *Eventline) Gate() *Gate { return el.gate }

// Store returns the versioning store (ListParked, ListSkipped, ReleaseGap).
func (el *Eventline) Store() *versioning.Store { return el.gate.store }

// Sweep makes one sweeper pass over the group's parked events (see
// versioning.Sweeper.Sweep).
func (el *Eventline) Sweep(ctx context.Context) (versioning.SweepResult, error) {
	res, err := el.sweeper.Sweep(el.withHookReports(ctx))
	el.gate.observeSweep(res, err)
	return res, err
}

// RunSweeper sweeps every SweepInterval until ctx ends, then returns nil.
// Each pass also replays the group's dead letters whose replay was
// requested (see [Eventline.ReplayDeadLetters]). Run it next to the router
// (the consumer package does).
func (el *Eventline) RunSweeper(ctx context.Context) error {
	ctx = el.withHookReports(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		el.runReplays(ctx)
	}()
	err := el.sweeper.Run(ctx)
	<-done
	return err
}

// DeadLetters returns the dead-letter middleware Chain and AddHandler use
// (its Store lists, replays and discards dead letters).
func (el *Eventline) DeadLetters() *DeadLetter { return el.dl }
