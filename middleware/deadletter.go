package middleware

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/nilcheck"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/tracing"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/versioning"
)

// DeadLetterConfig configures [DeadLetter].
type DeadLetterConfig struct {
	// DB is the consumer's database (its *pgxpool.Pool); each dead letter
	// is held in held_events (kind dead_letter) in its own transaction.
	// Required.
	DB dedup.DBTX
	// Group is the consumer group. Required.
	Group string
	// Schema is the PostgreSQL schema holding held_events. Defaults to
	// "eventline".
	Schema string
	// InfraInitialInterval and InfraMaxInterval pace the retries of a
	// dead-letter write that failed (the database is down): the message
	// stays unacknowledged until the write succeeds. Default to
	// DefaultInfraInitialInterval (250ms) and DefaultInfraMaxInterval (5s).
	InfraInitialInterval time.Duration
	InfraMaxInterval     time.Duration // see InfraInitialInterval
	// Logger receives a warning per dead letter. Defaults to
	// slog.Default().
	Logger *slog.Logger
	// Metrics, when set, counts dead letters by kind and failed writes.
	Metrics *Metrics
	// Sleep waits between write attempts (see Retry.Sleep).
	Sleep func(ctx context.Context, d time.Duration) error
	// TracerProvider, when set, records a "dead_letter <topic>" span per
	// dead letter written, a child of the message's process span (see
	// Eventline.Traced) or, without one, of the trace its headers carry;
	// the process span's eventline.outcome becomes dead_lettered.
	// Defaults to nil: no spans.
	TracerProvider trace.TracerProvider
	// Propagator reads the trace context from the message metadata when
	// there is no process span. Defaults to OpenTelemetry's global
	// propagator if the application set one, else W3C trace context and
	// baggage.
	Propagator propagation.TextMapPropagator
}

// DeadLetter takes the messages the rest of the chain gave up on off the
// partition, keeping them whole in the consumer's own database
// (held_events, kind dead_letter), where `eventline held` lists, replays
// and discards them. It replaces Watermill's PoisonQueue for eventline
// consumers.
//
// When the chain returns an error, DeadLetter:
//   - returns it, leaving the message unacknowledged (to be redelivered),
//     when the message's context has ended (shutdown), when it is an
//     infrastructure error ([IsInfrastructure]: nothing is wrong with the
//     event) or a *CompositionError;
//   - otherwise writes the message, byte for byte, with its cause and
//     reason, in its own transaction, and acknowledges it. A failed write
//     (or one the database does not answer within 30s) is retried, waiting
//     as [Retry] does for the database, until it succeeds or the context
//     ends: a message is never acknowledged without its dead letter. There is no size limit and no broker that
//     can refuse it, so a dead letter can never stall its partition.
//
// The kind is the error's own when it has a DeadLetterKind() string
// method, else dedup.KindPermanent, dedup.KindRetriesExhausted (a
// *RetriesExhaustedError from Retry) or dedup.KindFailed.
//
// Put it outermost: DeadLetter ▸ Retry ▸ eventline ▸ handler. Inside a
// consumer transaction it refuses to run, with a *CompositionError.
type DeadLetter struct {
	cfg   DeadLetterConfig
	store *held.Store
	tr    *tracing.Tracer // nil: tracing off
}

// NewDeadLetter returns the DeadLetter middleware. It fails, naming the
// field, when the configuration is invalid.
func NewDeadLetter(cfg DeadLetterConfig) (*DeadLetter, error) {
	if cfg.Schema == "" {
		cfg.Schema = migrations.DefaultSchema
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Sleep == nil {
		cfg.Sleep = sleep
	}
	if cfg.InfraInitialInterval == 0 {
		cfg.InfraInitialInterval = DefaultInfraInitialInterval
	}
	if cfg.InfraMaxInterval == 0 {
		cfg.InfraMaxInterval = max(DefaultInfraMaxInterval, cfg.InfraInitialInterval)
	}
	switch {
	case nilcheck.IsNil(cfg.DB):
		return nil, errors.New("middleware.DeadLetterConfig.DB is nil: give it the consumer's *pgxpool.Pool")
	case cfg.Group == "":
		return nil, errors.New("middleware.DeadLetterConfig.Group is empty: name the consumer group")
	case cfg.InfraInitialInterval < 0 || cfg.InfraMaxInterval < cfg.InfraInitialInterval:
		return nil, fmt.Errorf("middleware.DeadLetterConfig.InfraInitialInterval (%s) must be positive and at most InfraMaxInterval (%s)", cfg.InfraInitialInterval, cfg.InfraMaxInterval)
	}
	if err := sqlident.Validate("middleware.DeadLetterConfig.Schema", cfg.Schema); err != nil {
		return nil, err
	}
	return &DeadLetter{cfg: cfg, store: held.New(cfg.Schema), tr: tracing.New(cfg.TracerProvider, cfg.Propagator)}, nil
}

// Middleware returns the DeadLetter middleware.
func (d *DeadLetter) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, ok := TxFromContext(ctx); ok {
			return nil, &CompositionError{Problem: "middleware.DeadLetter runs inside a consumer transaction, so a dead-lettered event would be committed as processed",
				Fix: "put DeadLetter outermost, outside Retry and the eventline middleware (use Eventline.AddHandler)"}
		}
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		if ctx.Err() != nil || IsInfrastructure(err) || errors.Is(err, ErrUnsafeComposition) {
			return nil, err
		}
		rec := d.record(ctx, msg, err)
		id, werr := d.traceWrite(ctx, msg, rec)
		if werr != nil {
			return nil, errors.Join(err, werr)
		}
		d.cfg.Metrics.DeadLettered(d.cfg.Group, rec.Cause)
		// The record's fields are hostile input: the dead letter keeps them
		// whole, the warning only their start.
		d.cfg.Logger.WarnContext(ctx, "eventline: message dead-lettered; list and replay it with `eventline held`",
			"group", d.cfg.Group, "held_event_id", id, "topic", rec.Topic, "message_uuid", truncate(msg.UUID, maxLoggedField),
			"event_id", truncate(rec.EventID, maxLoggedField), "event_type", truncate(rec.EventType, maxLoggedField),
			"cause", rec.Cause, "error", truncate(err.Error(), maxLoggedError))
		return nil, nil
	}
}

// traceWrite is write inside a "dead_letter" span when tracing is on.
func (d *DeadLetter) traceWrite(ctx context.Context, msg *message.Message, rec held.Event) (int64, error) {
	if d.tr == nil {
		return d.write(ctx, msg, rec)
	}
	sctx := ctx
	proc, ok := processSpan(ctx)
	if ok {
		proc.SetAttributes(tracing.AttrOutcome.String(tracing.OutcomeDeadLettered))
	} else {
		sctx = d.tr.Extract(ctx, msg.Metadata)
	}
	_, span := d.tr.StartDeadLetter(sctx, rec.Topic, d.cfg.Group, rec.Cause, eventFromMetadata(msg.Metadata))
	id, err := d.write(ctx, msg, rec)
	tracing.End(span, err)
	return id, err
}

// writeTimeout bounds one attempt to write a dead letter, so a connection
// that stops answering is given up on and the write retried on another.
const writeTimeout = 30 * time.Second

// write stores rec, retrying until it succeeds or ctx ends.
func (d *DeadLetter) write(ctx context.Context, msg *message.Message, rec held.Event) (int64, error) {
	for attempt := 1; ; attempt++ {
		wctx, cancel := context.WithTimeout(ctx, writeTimeout)
		id, err := d.store.AddDeadLetter(wctx, d.cfg.DB, rec)
		cancel()
		if err == nil {
			if attempt > 1 {
				d.cfg.Logger.InfoContext(ctx, "eventline: dead letter written after failed attempts", "group", d.cfg.Group, "attempts", attempt)
			}
			return id, nil
		}
		if ctx.Err() != nil {
			return 0, fmt.Errorf("eventline: dead letter not written before shutdown; the message stays unacknowledged: %w", err)
		}
		d.cfg.Metrics.incDeadLetterWriteFailure(d.cfg.Group)
		log := d.cfg.Logger.DebugContext
		if attempt == 1 {
			log = d.cfg.Logger.ErrorContext
		}
		log(ctx, "eventline: cannot write the dead letter; the message stays unacknowledged and the write is retried",
			"group", d.cfg.Group, "message_uuid", truncate(msg.UUID, maxLoggedField), "attempt", attempt, "error", err)
		if d.cfg.Sleep(ctx, backoff(d.cfg.InfraInitialInterval, 2, d.cfg.InfraMaxInterval, attempt)) != nil {
			return 0, fmt.Errorf("eventline: dead letter not written before shutdown; the message stays unacknowledged: %w", err)
		}
	}
}

// maxLoggedError bounds the error in the dead-letter warning.
const maxLoggedError = 8 << 10

// maxLoggedField bounds each of the record's own fields (message UUID,
// event id, event type) in the dead-letter warning.
const maxLoggedField = 256

// truncate cuts s to at most n bytes, on a rune boundary, marking the cut
// with "…".
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for len(s) > 0 && !utf8.RuneStart(s[len(s)-1]) {
		s = s[:len(s)-1]
	}
	if len(s) > 0 {
		s = s[:len(s)-1]
	}
	return s + "…"
}

// record builds the dead letter of msg.
func (d *DeadLetter) record(ctx context.Context, msg *message.Message, err error) held.Event {
	src := SourceFromContext(ctx)
	rec := held.Event{
		Group: d.cfg.Group, Topic: src.Topic, Handler: src.Handler,
		FromKafka: src.FromKafka, Partition: src.Partition, Offset: src.Offset, Key: src.Key,
		MessageUUID: msg.UUID, Payload: msg.Payload, Metadata: maps.Clone(map[string]string(msg.Metadata)),
		Cause: DeadLetterKind(err), Reason: err.Error(),
	}
	if e, derr := eventline.Decode(msg); derr == nil {
		rec.EventID, rec.EventType, rec.AggregateType, rec.AggregateID, rec.AggregateVersion = e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion
		rec.PreviousVersion = e.PreviousVersion
	} else {
		md := msg.Metadata
		rec.EventID, rec.EventType = md.Get(eventline.MetaEventID), md.Get(eventline.MetaEventType)
		rec.AggregateType, rec.AggregateID = md.Get(eventline.MetaAggregateType), md.Get(eventline.MetaAggregateID)
		if v, perr := strconv.ParseInt(md.Get(eventline.MetaAggregateVersion), 10, 64); perr == nil && v > 0 {
			rec.AggregateVersion = v
		}
	}
	return rec
}

// DeadLetterKind classifies a dead-lettering error: the error's own kind
// when it (or an error it wraps) has a DeadLetterKind() string method,
// else dedup.KindPermanent, dedup.KindRetriesExhausted or
// dedup.KindFailed.
func DeadLetterKind(err error) string {
	var k interface{ DeadLetterKind() string }
	var exhausted *RetriesExhaustedError
	switch {
	case errors.As(err, &k) && k.DeadLetterKind() != "":
		return k.DeadLetterKind()
	case IsPermanent(err):
		return dedup.KindPermanent
	case errors.As(err, &exhausted):
		return dedup.KindRetriesExhausted
	}
	return dedup.KindFailed
}

// DeadLetterParked returns a function that dead-letters a parked event in
// the caller's transaction tx (so the dead letter commits with whatever
// else the caller does, such as recording a skipped version), held in
// schema's held_events with the given cause and reason. It fits a sweeper
// hook of the form func(ctx, tx, versioning.Parked, reason) error.
func DeadLetterParked(schema, cause string) func(ctx context.Context, tx pgx.Tx, p versioning.Parked, reason string) error {
	if schema == "" {
		schema = migrations.DefaultSchema
	}
	store := held.New(schema)
	return func(ctx context.Context, tx pgx.Tx, p versioning.Parked, reason string) error {
		rec := held.Event{
			Group: p.Group, Topic: p.Topic, Handler: p.Handler,
			MessageUUID: p.EventID, Payload: p.Payload, Metadata: p.Metadata,
			EventID: p.EventID, EventType: p.EventType, AggregateType: p.AggregateType, AggregateID: p.AggregateID,
			AggregateVersion: p.Version, PreviousVersion: p.PreviousVersion, Cause: cause, Reason: reason,
		}
		_, err := store.AddDeadLetter(ctx, tx, rec)
		return err
	}
}
