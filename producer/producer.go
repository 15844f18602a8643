package producer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strings"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// Config configures a Producer.
type Config struct {
	// Schema is the PostgreSQL schema eventline's migrations were applied
	// to. Defaults to "eventline".
	Schema string
	// DefaultTopic is the Kafka topic for events whose Topic is empty. When
	// it is empty too, every event must name its topic.
	DefaultTopic string
	// AllowVersionGaps lets a supplied AggregateVersion skip versions: any
	// version above the aggregate's last one is accepted, and the event
	// records the version it follows (Event.PreviousVersion, metadata
	// aggregate_previous_version), so consumers apply it right after that
	// one instead of waiting for the skipped numbers. Turn it on when
	// versions come from a store whose numbering is sparse by design.
	// Defaults to false: a supplied version must be exactly the next one,
	// and a jump fails with *VersionGapError.
	AllowVersionGaps bool
	// CallerVersionedTypes lists aggregate types whose versions the
	// caller owns, typically a version column of the aggregate's own row
	// that the business transaction increments (UPDATE … SET version =
	// version + 1 … RETURNING version), or the INSERT that creates the
	// aggregate at version 1. Every event of these types must carry its
	// AggregateVersion, and PublishTx writes only its outbox row: no
	// aggregate_sequences row is read, locked or written. Within one call
	// the versions of an aggregate must still follow each other (see
	// AllowVersionGaps); everything else is the caller's:
	//
	//   - each version is published once and none is skipped: the caller's
	//     transaction holds a lock on the aggregate (its row) until it
	//     commits, so concurrent writers of one aggregate take turns, and
	//     an event follows version AggregateVersion-1;
	//   - all of an aggregate's events go to one topic (the
	//     TopicConflictError check needs the sequence row);
	//   - events of these types are never published with assigned
	//     versions (AggregateVersion 0), by this producer or another: the
	//     outbox would number them from 1 again, and consumers would
	//     discard them as stale;
	//   - after a failover that lost commits, admin.AdvanceSequences does
	//     not cover them: move the caller's versions past those consumers
	//     hold before publishing again.
	//
	// An event of such a type without AggregateVersion fails with
	// *eventline.InvalidEventError before any SQL. Defaults to none.
	CallerVersionedTypes []string
	// MaxMessageBytes is the largest Kafka record (as Sarama sizes it, see
	// EncodedRecordSize) an event may become; a larger event fails with
	// *EventTooLargeError before anything is written. Set the relay's
	// RelayConfig.MaxMessageBytes to the same value. Defaults to
	// DefaultMaxMessageBytes (1 MiB).
	MaxMessageBytes int
	// SchemaVersions declares the current payload schema version of each
	// event type this producer writes. Events of a declared type published
	// with SchemaVersion 0 get the declared version; a SchemaVersion above
	// it fails with *SchemaVersionError. Events of other types default to
	// SchemaVersion 1. Defaults to none declared.
	SchemaVersions map[string]int
	// Propagator writes the caller's trace context (the span and baggage
	// in PublishTx's ctx) into each event that has no TraceParent: the
	// traceparent header becomes Event.TraceParent, the others (tracestate,
	// baggage) event metadata the caller did not set. When ctx holds no
	// valid span context and no baggage, nothing is written and the
	// propagator is not called. Defaults to OpenTelemetry's global
	// propagator (otel.GetTextMapPropagator, looked up at each call), which
	// writes nothing until the application sets one, typically
	// propagation.NewCompositeTextMapPropagator(propagation.TraceContext{},
	// propagation.Baggage{}).
	Propagator propagation.TextMapPropagator
	// Logger receives debug logs. Defaults to slog.Default().
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	c.Schema = cmp.Or(c.Schema, migrations.DefaultSchema)
	c.MaxMessageBytes = cmp.Or(c.MaxMessageBytes, DefaultMaxMessageBytes)
	c.Logger = cmp.Or(c.Logger, slog.Default())
	// A copy: the caller may go on changing its map. (New reads
	// CallerVersionedTypes into a map of its own.)
	c.SchemaVersions = maps.Clone(c.SchemaVersions)
	return c
}

func (c Config) validate() error {
	if err := sqlident.Validate("producer.Config.Schema", c.Schema); err != nil {
		return err
	}
	if c.DefaultTopic != "" {
		if err := eventline.ValidateTopic(c.DefaultTopic); err != nil {
			return fmt.Errorf("producer.Config.DefaultTopic: %w", err)
		}
	}
	if err := validateMaxMessageBytes("producer.Config.MaxMessageBytes", c.MaxMessageBytes); err != nil {
		return err
	}
	for typ, v := range c.SchemaVersions {
		if v < 1 {
			return fmt.Errorf("producer.Config.SchemaVersions[%q] must be at least 1, got %d", typ, v)
		}
	}
	for i, typ := range c.CallerVersionedTypes {
		if strings.TrimSpace(typ) == "" {
			return fmt.Errorf("producer.Config.CallerVersionedTypes[%d] is empty: name an aggregate type", i)
		}
	}
	return nil
}

// minMaxMessageBytes is the smallest MaxMessageBytes accepted: room for the
// envelope's headers of a small event.
const minMaxMessageBytes = 1024

// validateMaxMessageBytes checks Config's or RelayConfig's MaxMessageBytes:
// Sarama ignores (with a log line) a limit at or above its request size.
func validateMaxMessageBytes(field string, n int) error {
	if n < minMaxMessageBytes || n >= int(sarama.MaxRequestSize) {
		return fmt.Errorf("%s must be between %d and %d bytes (0 means the default, %d), got %d",
			field, minMaxMessageBytes, sarama.MaxRequestSize-1, DefaultMaxMessageBytes, n)
	}
	return nil
}

// Producer writes events into the transactional outbox. It is safe for
// concurrent use and holds no connections of its own.
type Producer struct {
	cfg    Config
	shards int
	stmts  *statements
	// callerVersioned holds Config.CallerVersionedTypes.
	callerVersioned map[string]bool
}

// New returns a Producer for the outbox in cfg.Schema, reading its shard
// count from the database. The schema must have been migrated
// (migrations.Up or `eventline migrate up`).
func New(ctx context.Context, db interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}, cfg Config) (*Producer, error) {
	if outbox.NilHandle(db) {
		return nil, errors.New("producer.New: db is nil: pass the producer's *pgxpool.Pool (or a pgx.Tx or *pgx.Conn)")
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	shards, err := outbox.ShardCount(ctx, db, cfg.Schema)
	if err != nil {
		return nil, err
	}
	callerVersioned := map[string]bool{}
	for _, typ := range cfg.CallerVersionedTypes {
		callerVersioned[typ] = true
	}
	return &Producer{cfg: cfg, shards: shards, stmts: newStatements(cfg.Schema), callerVersioned: callerVersioned}, nil
}

// PublishTx writes events into the outbox inside tx, the caller's own
// transaction. They become visible to the relay when tx commits and vanish
// with it on rollback: the business rows and their events are atomic. It
// costs one round trip to PostgreSQL however many events it writes.
//
// Before any SQL runs, every event is checked; an event that is invalid
// (*eventline.InvalidEventError, which covers NUL bytes and invalid UTF-8
// in metadata), too large for Kafka (*EventTooLargeError, see
// Config.MaxMessageBytes), of an undeclared schema version
// (*SchemaVersionError), inconsistent with the call's other events of its
// aggregate, or with the id of another event of the call
// (*eventline.InvalidEventError) fails the whole call and leaves tx
// untouched.
//
// Versions. Events without an AggregateVersion get the next versions of
// their aggregate, allocated in tx: concurrent writers of one aggregate
// wait for each other's commit, and every aggregate of a call is locked in
// one pass in (aggregate type, id) order, so concurrent calls never
// deadlock on each other. A supplied version must be the aggregate's next
// one (its last version plus one, counting the events before it in the
// call): a lower one fails with *VersionConflictError, a higher one with
// *VersionGapError unless Config.AllowVersionGaps is set. Every event
// records the version it follows (Event.PreviousVersion); it is written to
// the envelope when it is not AggregateVersion-1. Events of one aggregate
// keep the order given.
//
// Topics. All events of one aggregate go to one Kafka topic, the topic of
// the first event published for it (recorded with its sequence), so a
// consumer of that topic sees every version. An event for another topic
// fails with *TopicConflictError.
//
// These conflicts are found in the database and reported without writing
// anything; tx stays usable. Other database errors abort tx as usual.
//
// Tracing. When ctx carries a span context or baggage, events without a
// TraceParent get the caller's trace context (see Config.Propagator).
func (p *Producer) PublishTx(ctx context.Context, tx pgx.Tx, events ...eventline.Event) error {
	_, err := p.PublishTxReturning(ctx, tx, events...)
	return err
}

// PublishTxReturning is PublishTx, returning the events as written, in the
// order given: with their ids, aggregate versions, previous versions,
// schema versions, topics, trace context and occurred_at filled in.
func (p *Producer) PublishTxReturning(ctx context.Context, tx pgx.Tx, events ...eventline.Event) ([]eventline.Event, error) {
	if outbox.NilHandle(tx) {
		return nil, errors.New("eventline: PublishTx needs a transaction, got nil")
	}
	if len(events) == 0 {
		return nil, nil
	}
	pl, err := p.prepare(ctx, events)
	if err != nil {
		return nil, err
	}
	if err := p.write(ctx, tx, pl); err != nil {
		return nil, err
	}
	return pl.events, nil
}

// Publish writes events in a transaction of its own, for events that have
// no business rows to commit with. See PublishTx.
func (p *Producer) Publish(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, events ...eventline.Event) error {
	if outbox.NilHandle(db) {
		return errors.New("producer.Publish: db is nil: pass the producer's *pgxpool.Pool (or a *pgx.Conn)")
	}
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return p.PublishTx(ctx, tx, events...) })
}

type aggregateKey struct{ typ, id string }
