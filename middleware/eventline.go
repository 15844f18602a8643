package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/nilcheck"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/internal/txhooks"
)

// Pool is the database handle the middleware needs: batches that begin
// transactions for events, and queries and transactions for the sweeper
// and dead letters. *pgxpool.Pool satisfies it.
type Pool interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Eventline applies each event once, in per-aggregate order, in a
// PostgreSQL transaction, around a Watermill handler; [Eventline.Run]
// applies parked events later and replays dead letters. What it does with
// each message, and with each kind of failure, is the package
// documentation's subject.
//
// [Eventline.AddHandler] puts dead letters and retries around it in the
// only safe order; [Eventline.MiddlewareFor] is the middleware alone.
type Eventline struct {
	db      Pool
	cfg     Config // defaults filled in, validated
	gate    *gate
	sweeper *store.Sweeper
	held    *held.Store // dead letters (held_events)
	// hookPanic is reportHookPanic, bound once: the contexts of the
	// consumer transactions report their AfterCommit hooks' panics to it.
	hookPanic txhooks.PanicHandler
}

// New returns the middleware for the consumer group cfg.Group, writing
// through db (the consumer's *pgxpool.Pool; keep it open for the
// middleware's lifetime). It fails, naming the field, when the
// configuration is invalid. It connects to nothing.
func New(db Pool, cfg Config) (*Eventline, error) {
	if nilcheck.IsNil(db) {
		return nil, errors.New("middleware.New: db is nil: pass the consumer's *pgxpool.Pool")
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	st, err := store.New(cfg.Schema)
	if err != nil {
		return nil, err
	}
	obs, err := newObserver(cfg.TracerProvider, cfg.Propagator, cfg.MeterProvider)
	if err != nil {
		return nil, fmt.Errorf("middleware.Config.MeterProvider: %w", err)
	}
	el := &Eventline{db: db, cfg: cfg, held: st.Held()}
	el.hookPanic = el.reportHookPanic
	el.gate = &gate{cfg: &el.cfg, check: upcastable(cfg.Upcasters, cfg.Validate), store: st, reg: newRegistry(), obs: obs}
	el.sweeper = el.gate.newSweeper(db)
	return el, nil
}

// MiddlewareFor returns the middleware alone, for one handler of your
// Router (router.AddConsumerHandler(name, …).AddMiddleware(…)): it
// registers the handler it wraps under handlerName, the Router's name for
// it, so that the sweeper and dead-letter replays apply events through
// the handler they arrived on. Errors come back to the Router as they
// are: prefer [Eventline.AddHandler], which puts eventline's retries and
// dead letters around it.
func (el *Eventline) MiddlewareFor(handlerName string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc { return el.wrap(handlerName, el.upcasting(h)) }
}

// wrap registers inner (the handler behind the upcasters) under name, for
// the sweeper and replays, and returns the eventline middleware around it.
func (el *Eventline) wrap(name string, inner message.HandlerFunc) message.HandlerFunc {
	el.gate.reg.register(name, inner)
	return el.handler(el.guard(inner))
}

// Sweep makes one sweeper pass now, as Run does every SweepInterval: it
// applies the parked events whose turn came, gives up on gaps older than
// ParkTimeout, and applies the late events an operator asked for (in
// tests, it stands for the passage of time).
func (el *Eventline) Sweep(ctx context.Context) error {
	_, err := el.sweep(ctx)
	return err
}

// sweep makes one sweeper pass and counts it.
func (el *Eventline) sweep(ctx context.Context) (store.SweepResult, error) {
	res, err := el.sweeper.Sweep(txhooks.WithPanicHandler(ctx, el.hookPanic))
	el.gate.observeSweep(res, err)
	return res, err
}

// Run checks that the consumer's schema is migrated, then sweeps every
// SweepInterval until ctx ends, and returns nil: it applies parked events
// once their missing versions arrived or were given up on, and late events
// an operator asked to apply. Each pass also replays the group's dead
// letters whose replay was requested (`eventline held replay`).
// Run it next to the router (the consumer package does).
//
// A schema without eventline's consumer tables (or before their newest
// shape) fails at once with an error matching ErrNotMigrated that names
// the schema and what to run. While the database is unavailable, Run waits
// for it (on Config.InfraBackoff's schedule) before it checks.
func (el *Eventline) Run(ctx context.Context) error {
	if err := el.checkMigrated(ctx); err != nil {
		return err
	}
	ctx = txhooks.WithPanicHandler(ctx, el.hookPanic)
	done := make(chan struct{})
	go func() {
		defer close(done)
		el.runReplays(ctx)
	}()
	err := el.sweeper.Run(ctx)
	<-done
	return err
}

// handler is the eventline middleware around inner: recover ▸ trace ▸
// decode ▸ begin and admit ▸ gate ▸ inner ▸ commit.
func (el *Eventline) handler(inner message.HandlerFunc) message.HandlerFunc {
	g := el.gate
	return g.obs.traced(el.cfg.Group, recoverPanics(func(msg *message.Message) (out []*message.Message, err error) {
		parent := msg.Context()
		if _, nested := TxFromContext(parent); nested {
			return nil, &CompositionError{Problem: "the eventline middleware runs inside another consumer transaction",
				Fix: "add it once per handler: AddHandler, or MiddlewareFor alone"}
		}
		e, err := decode(msg)
		if err != nil {
			return nil, err
		}
		if e.Topic == "" {
			e.Topic = delivery.SourceOf(parent).Topic
		}
		if err := g.precheck(e); err != nil {
			return nil, err
		}
		// AfterCommit hooks registered from here on report their panics
		// to el (the hooks are recovered where they run).
		hctx := txhooks.WithPanicHandler(parent, el.hookPanic)
		if s := delivery.SlotOf(parent); s != nil {
			// A member of a batch: applied with the others (runBatch, tx.go),
			// or told to run on its own below.
			msg.SetContext(delivery.WithEvent(hctx, e))
			if out, err, alone := s.Arrive(el, el.runBatch, msg, e, inner); !alone {
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
		msg.SetContext(delivery.WithEvent(ctx, e))
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
func (el *Eventline) begin(ctx context.Context, e eventline.Event) (pgx.Tx, store.Admission, error) {
	b := &pgx.Batch{}
	b.BeginTx(el.cfg.TxOptions)
	admission := el.gate.queueAdmission(b, e)
	tx, err := el.sendBegin(ctx, ctx, b, "consumer")
	if err != nil {
		return nil, store.Admission{}, err
	}
	a, err := admission(ctx, tx)
	if err != nil {
		rollback(ctx, tx)
		return nil, store.Admission{}, el.gate.admissionError(ctx, e, err)
	}
	return tx, a, nil
}

// admissionError turns an admission's error into what the event's chain
// gets: an id conflict is refused (permanent, counted, dead-lettered),
// anything else is returned as is.
func (g *gate) admissionError(ctx context.Context, e eventline.Event, err error) error {
	if errors.Is(err, dedup.ErrIDConflict) {
		return g.refuse(ctx, e, refusedIDConflict, err)
	}
	return err
}

// sendBegin sends b, which begins a transaction (what names it in the
// error) and queues its admissions, under bctx, and returns the
// transaction; when b fails, the transaction is rolled back under ctx.
func (el *Eventline) sendBegin(ctx, bctx context.Context, b *pgx.Batch, what string) (pgx.Tx, error) {
	br := el.db.SendBatch(bctx, b)
	tx := br.Tx()
	err := br.Close()
	if tx == nil {
		return nil, errNoBatchTx
	}
	if err != nil {
		rollback(ctx, tx)
		return nil, fmt.Errorf("eventline: begin %s transaction: %w", what, err)
	}
	return tx, nil
}

var errNoBatchTx = errors.New("eventline: the consumer pool's SendBatch did not begin a transaction (pgx.Batch.BeginTx needs pgx v5.12 or later)")

// admissionResult reads a queued admission through the batch's
// transaction.
type admissionResult = func(ctx context.Context, tx store.DBTX) (store.Admission, error)

// queueAdmission queues on b the statement that admits e: it records the
// event id in processed_events and, for a versioned event, locks, checks
// and advances its aggregate's version. The returned function reads the
// admission, through the batch's transaction, once the batch results are
// closed; a duplicate of an unversioned event reads as
// store.Duplicate, an applicable unversioned event as the zero
// Admission. Both the one-event path and batches admit through it.
func (g *gate) queueAdmission(b *pgx.Batch, e eventline.Event) admissionResult {
	if e.AggregateVersion > 0 {
		p := g.store.QueueAdmit(b, g.cfg.Group, e, g.jumps(e))
		return p.Result
	}
	p := g.store.QueueRecordProcessed(b, g.cfg.Group, e, dedup.OutcomeApplied)
	return func(ctx context.Context, tx store.DBTX) (store.Admission, error) {
		fresh, err := p.Result(ctx, tx)
		if err != nil {
			return store.Admission{}, err
		}
		if !fresh {
			return store.Admission{Verdict: store.Duplicate}, nil
		}
		return store.Admission{}, nil
	}
}

// upcastable is validate preceded by the check that up can bring the
// event to the current schema version of its type: an event it cannot is
// refused before it parks or is held as late, as the handler would refuse
// it in order, so it is dead-lettered and its successors wait behind it
// instead of being applied first. validate still sees the event as
// received. Without upcasters it is validate.
func upcastable(up *eventline.Upcasters, validate func(context.Context, eventline.Event) error) func(context.Context, eventline.Event) error {
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

// upcasting is h behind Config.Upcasters, or h itself without them: the
// handler gets every event at the current payload schema version of its
// type. An event the upcasters cannot bring there fails permanently and
// never reaches the handler.
func (el *Eventline) upcasting(h message.HandlerFunc) message.HandlerFunc {
	up := el.cfg.Upcasters
	if up == nil {
		return h
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		e, err := eventOf(msg)
		if err != nil {
			return nil, err
		}
		m, err := delivery.Upcast(up, msg, e)
		if err != nil {
			return nil, Permanent(err)
		}
		return h(m)
	}
}

// checkMigrated returns an error matching ErrNotMigrated when the schema
// lacks the consumer tables, waiting while the database is unavailable;
// nil when they are there or ctx ended first.
func (el *Eventline) checkMigrated(ctx context.Context) error {
	var problem string
	err := backoff.Retry(ctx, el.cfg.InfraBackoff, IsInfrastructure,
		func(wait time.Duration, err error) {
			el.cfg.Logger.WarnContext(ctx, "eventline: the consumer's database is unavailable; waiting for it before consuming",
				"group", el.cfg.Group, "wait", wait, "error", err)
		},
		func() (err error) {
			problem, err = el.gate.store.Unmigrated(ctx, el.db)
			return err
		})
	switch {
	case err != nil:
		return err
	case problem != "":
		return fmt.Errorf("%w: %s", ErrNotMigrated, problem)
	}
	return nil
}
