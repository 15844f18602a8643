package middleware

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// DedupConfig configures the Dedup middleware.
type DedupConfig struct {
	// Group is the consumer group the records belong to. Required.
	Group string
	// Schema is the PostgreSQL schema holding processed_events. Defaults
	// to "eventline".
	Schema string
	// Logger receives a debug line per duplicate. Defaults to
	// slog.Default().
	Logger *slog.Logger
	// Metrics, when set, counts duplicates.
	Metrics *Metrics
}

// Dedup skips events the consumer group has already handled. In the
// consumer transaction from the context (put [Tx] outside it) it inserts
// the event's processed_events row; when the row already exists the event
// is a duplicate: the handler does not run and the message is acknowledged.
// The row commits or rolls back with the handler's effects, so a handler
// error leaves nothing behind and the redelivery is handled normally.
//
// The row is keyed by the event id within its aggregate: an event of
// another aggregate that carries a recorded id is another event. A
// recorded row that belongs to a different event of the same aggregate
// (another type or version under the same id) is not a duplicate but an id
// conflict: Dedup fails with a permanent *dedup.IDConflictError, so the
// event is dead-lettered with that reason and counted in
// eventline_consumer_events_refused_total{reason="id_conflict"}.
//
// Unlike Watermill's Deduplicator middleware, which remembers a key before
// the handler runs and so drops a message whose handler failed, Dedup
// records nothing that outlives a failure.
type Dedup struct {
	cfg   DedupConfig
	store *dedup.Store
}

// NewDedup returns the Dedup middleware. It fails, naming the field, when
// the configuration is invalid.
func NewDedup(cfg DedupConfig) (*Dedup, error) {
	if cfg.Schema == "" {
		cfg.Schema = migrations.DefaultSchema
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Group == "" {
		return nil, fmt.Errorf("middleware.DedupConfig.Group is empty: name the consumer group")
	}
	if err := sqlident.Validate("middleware.DedupConfig.Schema", cfg.Schema); err != nil {
		return nil, err
	}
	store, err := dedup.NewStore(cfg.Schema)
	if err != nil {
		return nil, err
	}
	return &Dedup{cfg: cfg, store: store}, nil
}

// Middleware returns the Dedup middleware.
func (d *Dedup) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, ok := TxFromContext(ctx)
		if !ok {
			return nil, ErrNoTx
		}
		e, err := eventOf(msg)
		if err != nil {
			return nil, err
		}
		fresh, err := d.store.Insert(ctx, tx, d.cfg.Group, e, dedup.OutcomeApplied)
		if errors.Is(err, dedup.ErrIDConflict) {
			d.cfg.Metrics.incRefused(d.cfg.Group, RefusedIDConflict)
			d.cfg.Logger.WarnContext(ctx, "eventline: event refused; it is dead-lettered", "group", d.cfg.Group, "event_id", e.ID,
				"reason", RefusedIDConflict, "error", err)
			return nil, Permanent(err)
		}
		if err != nil {
			return nil, err
		}
		if !fresh {
			d.cfg.Logger.DebugContext(ctx, "eventline: duplicate event skipped", "group", d.cfg.Group, "event_id", e.ID, "event_type", e.Type)
			group, m := d.cfg.Group, d.cfg.Metrics
			AfterCommit(ctx, func() { m.incDuplicate(group, e.Type) })
			return nil, nil
		}
		return h(msg)
	}
}
