package producer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// DBTX is the smallest database handle the producer needs to read its
// configuration; *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Config configures a Producer.
type Config struct {
	// Schema is the PostgreSQL schema eventline's migrations were applied
	// to. Defaults to "eventline".
	Schema string
	// DefaultTopic is the Kafka topic for events whose Topic is empty. When
	// it is empty too, every event must name its topic.
	DefaultTopic string
	// Logger receives debug logs. Defaults to slog.Default().
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.Schema == "" {
		c.Schema = migrations.DefaultSchema
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
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
	return nil
}

// ErrNotMigrated is returned by New when the schema has no outbox.
var ErrNotMigrated = errors.New("eventline: outbox schema is not migrated")

// Producer writes events into the transactional outbox. It is safe for
// concurrent use and holds no connections of its own.
type Producer struct {
	cfg    Config
	shards int
	sql    producerSQL
	// wsqlConfig is watermill-sql's publisher configuration for the shard
	// tables. AutoInitializeSchema stays off: no DDL ever runs in a
	// caller's transaction.
	wsqlConfig wsql.PublisherConfig
}

// New returns a Producer for the outbox in cfg.Schema, reading its shard
// count from the database. The schema must have been migrated
// (migrations.Up or `eventline migrate up`).
func New(ctx context.Context, db DBTX, cfg Config) (*Producer, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	shards, err := ReadShardCount(ctx, db, cfg.Schema)
	if err != nil {
		return nil, err
	}
	return &Producer{
		cfg:        cfg,
		shards:     shards,
		sql:        newProducerSQL(cfg.Schema),
		wsqlConfig: wsql.PublisherConfig{SchemaAdapter: outbox.SchemaAdapter(cfg.Schema, 0)},
	}, nil
}

// ReadShardCount returns the number of outbox shards recorded in schema.
func ReadShardCount(ctx context.Context, db DBTX, schema string) (int, error) {
	var shards int
	err := db.QueryRow(ctx, `SELECT shards FROM `+sqlident.Qualify(schema, "outbox_config")).Scan(&shards)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000") || errors.Is(err, pgx.ErrNoRows) {
			return 0, fmt.Errorf("%w: schema %q has no outbox_config; run `eventline migrate up` or migrations.Up first", ErrNotMigrated, schema)
		}
		return 0, fmt.Errorf("read outbox shard count: %w", err)
	}
	return shards, nil
}

// Shards returns the number of outbox shards.
func (p *Producer) Shards() int { return p.shards }

// ShardFor returns the outbox shard an aggregate's events are written to.
func (p *Producer) ShardFor(aggregateType, aggregateID string) int {
	return outbox.ShardFor(aggregateType, aggregateID, p.shards)
}

// PublishTx writes events into the outbox inside tx, the caller's own
// transaction. They become visible to the relay when tx commits and vanish
// with it on rollback: the business rows and their events are atomic.
//
// Every event is validated before any SQL runs; an invalid event fails the
// whole call with an error wrapping *eventline.InvalidEventError and leaves
// tx untouched and usable. Events without an AggregateVersion get the next
// version of their aggregate, allocated in tx (concurrent writers of one
// aggregate wait for each other's commit). A supplied version that is not
// greater than the aggregate's last one fails with *VersionConflictError,
// also leaving tx usable. Events of one aggregate keep the order given.
func (p *Producer) PublishTx(ctx context.Context, tx pgx.Tx, events ...eventline.Event) error {
	_, err := p.PublishTxReturning(ctx, tx, events...)
	return err
}

// PublishTxReturning is PublishTx, returning the events as written: with
// their ids, aggregate versions, topics and occurred_at filled in, in the
// order given.
func (p *Producer) PublishTxReturning(ctx context.Context, tx pgx.Tx, events ...eventline.Event) ([]eventline.Event, error) {
	if tx == nil {
		return nil, errors.New("eventline: PublishTx needs a transaction, got nil")
	}
	if len(events) == 0 {
		return nil, nil
	}
	prepared, err := p.prepare(events, time.Now())
	if err != nil {
		return nil, err
	}
	if !anySupplied(prepared) {
		if err := p.assignVersions(ctx, tx, prepared); err != nil {
			return nil, err
		}
		return prepared, p.insert(ctx, tx, prepared)
	}
	// A supplied version can conflict after other aggregates' sequences
	// moved; a savepoint undoes them so tx stays clean and usable.
	err = pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		if err := p.assignVersions(ctx, sp, prepared); err != nil {
			return err
		}
		return p.insert(ctx, sp, prepared)
	})
	if err != nil {
		return nil, err
	}
	return prepared, nil
}

func anySupplied(events []eventline.Event) bool {
	for _, e := range events {
		if e.AggregateVersion != 0 {
			return true
		}
	}
	return false
}

// Publish writes events in a transaction of its own, for events that have
// no business rows to commit with. See PublishTx.
func (p *Producer) Publish(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, events ...eventline.Event) error {
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return p.PublishTx(ctx, tx, events...) })
}

// prepare validates events and fills in their defaults, without SQL.
func (p *Producer) prepare(events []eventline.Event, now time.Time) ([]eventline.Event, error) {
	out := make([]eventline.Event, len(events))
	lastSupplied := map[aggregateKey]int64{}
	for i, e := range events {
		if e.Topic == "" {
			e.Topic = p.cfg.DefaultTopic
		}
		if e.Topic == "" {
			return nil, fmt.Errorf("event %d: %w", i, &eventline.InvalidEventError{Field: "topic", Reason: "must not be empty: set Event.Topic or producer.Config.DefaultTopic"})
		}
		if err := e.Validate(); err != nil {
			return nil, fmt.Errorf("event %d: %w", i, err)
		}
		if e.AggregateVersion > 0 {
			k := aggregateKey{e.AggregateType, e.AggregateID}
			if prev, ok := lastSupplied[k]; ok && e.AggregateVersion <= prev {
				return nil, fmt.Errorf("event %d: %w", i, &eventline.InvalidEventError{
					Field: "aggregate_version", Value: fmt.Sprint(e.AggregateVersion),
					Reason: fmt.Sprintf("must be greater than version %d given earlier in the same call", prev),
				})
			}
			lastSupplied[k] = e.AggregateVersion
		}
		out[i] = e.WithDefaults(now)
	}
	return out, nil
}

// insert writes the events through watermill-sql's publisher on the
// caller's transaction, wrapped in Watermill's forwarder envelope so the
// relay (a forwarder) knows each event's Kafka topic. Consecutive events
// with the same shard and topic share one INSERT; the order of one
// aggregate's events is kept.
func (p *Producer) insert(ctx context.Context, tx pgx.Tx, events []eventline.Event) error {
	sqlPub, err := wsql.NewPublisher(wsql.TxFromPgx(tx), p.wsqlConfig, nil)
	if err != nil {
		return fmt.Errorf("create outbox publisher: %w", err)
	}
	// One run per (shard, topic) stretch; a shard's runs keep event order.
	type run struct {
		shard int
		topic string
		msgs  []*message.Message
	}
	var runs []*run
	open := make(map[int]*run, 4) // the current run of each shard
	for _, e := range events {
		msg, err := eventline.Encode(e)
		if err != nil {
			return err // unreachable: prepare validated every event
		}
		msg.SetContext(ctx)
		shard := p.ShardFor(e.AggregateType, e.AggregateID)
		r := open[shard]
		if r == nil || r.topic != e.Topic {
			r = &run{shard: shard, topic: e.Topic}
			open[shard] = r
			runs = append(runs, r)
		}
		r.msgs = append(r.msgs, msg)
	}
	for _, r := range runs {
		pub := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: outbox.Topic(r.shard)})
		if err := pub.Publish(r.topic, r.msgs...); err != nil {
			return fmt.Errorf("write %d event(s) to outbox shard %d: %w", len(r.msgs), r.shard, err)
		}
	}
	return nil
}
