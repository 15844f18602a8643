package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
)

// HeldKind is the kind of a held event: what held it, and what its replay
// does.
type HeldKind = held.Kind

// The kinds of held events.
const (
	// HeldRelayDeadLetter: an outbox row the relay gave up publishing
	// (Kafka rejected it for good, or every attempt failed). It is held in
	// the producer's database; a replay re-enqueues it into its outbox
	// shard at once, with the same envelope.
	HeldRelayDeadLetter = held.KindRelayDeadLetter
	// HeldDeadLetter: a message a consumer group gave up on (it can never
	// succeed as it is, or its handler kept failing). It is held in the
	// consumer's database; a running consumer of the group replays it
	// through the version gate and the handler it arrived on.
	HeldDeadLetter = held.KindDeadLetter
	// HeldLate: an event a consumer group received but can no longer
	// apply in order, because its aggregate passed its version. A running
	// consumer of the group applies it late on request, the handler told
	// (middleware.IsLate).
	HeldLate = held.KindLate
)

// HeldStatus is where a held event is in its life: held, then
// replay_requested (consumer kinds), then replayed; or discarded.
type HeldStatus = held.Status

// The statuses of a held event.
const (
	// StatusHeld: waiting for an operator (a failed replay comes back
	// here, with its error).
	StatusHeld = held.StatusHeld
	// StatusReplayRequested: a running consumer of the group replays it on
	// its next sweep.
	StatusReplayRequested = held.StatusReplayRequested
	// StatusReplayed: re-enqueued into the outbox (the relay's), or run
	// through its handler and committed.
	StatusReplayed = held.StatusReplayed
	// StatusDiscarded: given up, with the operator's reason.
	StatusDiscarded = held.StatusDiscarded
)

// HeldEvent is an event held for the operator: the message kept whole,
// every byte of its payload and headers as received (or, for the relay's,
// as its outbox row held it), with no size limit. Its fields are
// documented on the type it names.
type HeldEvent = held.Event

// HeldFilter selects held events (ListHeld, ReplayHeld, DiscardHeld).
// Empty fields match everything; its fields are documented on the type
// it names.
type HeldFilter = held.Filter

// ErrNoHeld is returned by ReplayHeld and DiscardHeld when no held event
// the filter selects can be replayed or discarded.
var ErrNoHeld = held.ErrNone

// ListHeld returns the held events f selects, oldest first: by default
// those waiting for an operator or for their replay.
func ListHeld(ctx context.Context, db DBTX, schema string, f HeldFilter) ([]HeldEvent, error) {
	if err := checkFilter("ListHeld", db, schema, f); err != nil {
		return nil, err
	}
	return held.New(schema).List(ctx, db, f)
}

// HeldReplay reports what ReplayHeld did.
type HeldReplay struct {
	// Enqueued are the relay dead letters put back into their outbox
	// shard: a running relay publishes them like new rows, with the same
	// event id and aggregate version. They are replayed.
	Enqueued []int64
	// Requested are the consumer dead letters and late events now waiting
	// for a running consumer of their group, which replays them on its
	// next sweep.
	Requested []int64
	// ArrivesLate lists the enqueued relay dead letters whose version some
	// consumer group (with its tables in schema) already gave up on: there
	// the replay arrives late and is held (kind late), not applied in
	// order.
	ArrivesLate []LateArrival
}

// LateArrival is a relay dead letter whose version consumer groups gave
// up on before it was replayed.
type LateArrival struct {
	// ID is the held event.
	ID int64
	// EventID and the aggregate's type, id and version name the event.
	EventID          string
	AggregateType    string // see EventID
	AggregateID      string // see EventID
	AggregateVersion int64  // see EventID
	// Groups are the consumer groups that recorded its version as
	// skipped.
	Groups []string
}

// groupsSkippedSQL lists, for each held event of $1, the consumer groups
// that recorded its aggregate version in skipped_versions.
const groupsSkippedSQL = `SELECT h.id, array_agg(DISTINCT s.consumer_group ORDER BY s.consumer_group)
	FROM {schema}.held_events h JOIN {schema}.skipped_versions s
		ON s.aggregate_type = h.aggregate_type AND s.aggregate_id = h.aggregate_id AND h.aggregate_version BETWEEN s.from_version AND s.to_version
	WHERE h.id = ANY($1) AND h.aggregate_version > 0
	GROUP BY h.id ORDER BY h.id`

// ReplayHeld replays the held events f selects among those waiting for an
// operator (status held), per aggregate in version order, in one
// transaction, and says what it did; ErrNoHeld when none matched. What a
// replay is depends on the kind:
//
//   - a relay dead letter is re-enqueued into its outbox shard at once,
//     with the same envelope (event id, aggregate version, topic), and
//     marked replayed; the relay publishes it like a new row. Consumers
//     that parked later versions apply it in order if it reaches them
//     within their park timeout; a group that already gave up on the
//     version (HeldReplay.ArrivesLate) holds it as late instead.
//   - a consumer dead letter becomes replay_requested: a running consumer
//     of its group runs it once through the version gate and the handler
//     it arrived on, per aggregate in version order, and marks it
//     replayed; a replay that fails puts it back to held, with the error,
//     and holds back the aggregate's later dead letters. A dead letter
//     whose version its aggregate passed while it was held is never
//     dropped as stale: it is held again, as late, cause version_conflict.
//   - a late event becomes replay_requested: the group's sweeper applies
//     it late, the handler told (middleware.IsLate), and marks it
//     replayed; after the consumer's release-attempt limit of failures it
//     is back to held with its last error.
//
// A dead letter or late event is replayed by a running consumer of its
// group, from the database the consumer uses: run ReplayHeld there.
func ReplayHeld(ctx context.Context, db Beginner, schema string, f HeldFilter) (HeldReplay, error) {
	var res HeldReplay
	if err := checkFilter("ReplayHeld", db, schema, f); err != nil {
		return res, err
	}
	f.Statuses = []held.Status{held.StatusHeld}
	store := held.New(schema)
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		res = HeldReplay{}
		events, err := store.Lock(ctx, tx, f)
		if err != nil {
			return err
		}
		if len(events) == 0 {
			return ErrNoHeld
		}
		var relay []held.Event
		for _, e := range events {
			if e.Kind == held.KindRelayDeadLetter {
				relay = append(relay, e)
				res.Enqueued = append(res.Enqueued, e.ID)
			} else {
				res.Requested = append(res.Requested, e.ID)
			}
		}
		if len(res.Requested) > 0 {
			if err := store.MarkRequested(ctx, tx, res.Requested...); err != nil {
				return err
			}
		}
		if len(relay) == 0 {
			return nil
		}
		if err := enqueue(ctx, tx, schema, relay); err != nil {
			return err
		}
		if err := store.MarkReplayed(ctx, tx, res.Enqueued...); err != nil {
			return err
		}
		res.ArrivesLate, err = arrivesLate(ctx, tx, schema, relay)
		return err
	})
	if err != nil {
		return HeldReplay{}, err
	}
	return res, nil
}

// enqueue puts relay dead letters back into their outbox shards, in order.
func enqueue(ctx context.Context, tx pgx.Tx, schema string, events []held.Event) error {
	pub, err := wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: outbox.SchemaAdapter(schema, 0)}, nil)
	if err != nil {
		return err
	}
	for _, e := range events {
		msg := e.Message()
		if !json.Valid(msg.Payload) {
			// The outbox column is json: a payload that is not was
			// malformed on the way in and is replayed without it, as is
			// metadata the relay could not read (kept under its own key).
			msg.Payload = nil
		}
		for k := range msg.Metadata {
			if strings.HasPrefix(k, "_eventline_outbox_") {
				delete(msg.Metadata, k)
			}
		}
		msg.SetContext(ctx)
		if err := pub.Publish(outbox.Topic(e.Shard), msg); err != nil {
			return fmt.Errorf("re-enqueue held event %d into outbox shard %d: %w", e.ID, e.Shard, err)
		}
	}
	return nil
}

// arrivesLate finds the consumer groups in schema that gave up on the
// versions of the relay dead letters events.
func arrivesLate(ctx context.Context, tx pgx.Tx, schema string, events []held.Event) ([]LateArrival, error) {
	byID := map[int64]held.Event{}
	ids := make([]int64, len(events))
	for i, e := range events {
		byID[e.ID], ids[i] = e, e.ID
	}
	rows, err := tx.Query(ctx, sqlident.SQL(schema, groupsSkippedSQL), ids)
	if err != nil {
		return nil, fmt.Errorf("look for consumer groups that skipped the replayed versions: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (LateArrival, error) {
		var a LateArrival
		if err := row.Scan(&a.ID, &a.Groups); err != nil {
			return a, err
		}
		e := byID[a.ID]
		a.EventID, a.AggregateType, a.AggregateID, a.AggregateVersion = e.EventID, e.AggregateType, e.AggregateID, e.AggregateVersion
		return a, nil
	})
}

// DiscardHeld gives up on the held events f selects among the open ones
// (held or replay_requested), recording reason (required: it is kept for
// the audit), and returns their ids; ErrNoHeld when none matched. They
// stay listed, discarded, and are never replayed. A discarded late event's
// dedup record says late_discarded, so a redelivery stays a duplicate. The
// versions of discarded dead letters stay missing: a consumer that parked
// later versions of the aggregate applies them after its park timeout (or
// at once after `eventline parked release`).
func DiscardHeld(ctx context.Context, db DBTX, schema string, f HeldFilter, reason string) ([]int64, error) {
	if err := checkFilter("DiscardHeld", db, schema, f); err != nil {
		return nil, err
	}
	if strings.TrimSpace(reason) == "" {
		return nil, errors.New("admin.DiscardHeld: reason is empty: say why these events are given up (it is kept with them)")
	}
	return held.New(schema).Discard(ctx, db, f, reason)
}

// checkFilter validates fn's arguments.
func checkFilter(fn string, db any, schema string, f HeldFilter) error {
	if err := checkArgs(fn, db, schema); err != nil {
		return err
	}
	if f.Kind != "" && !f.Kind.Valid() {
		return fmt.Errorf("admin.%s: HeldFilter.Kind %q is unknown: use %s, %s or %s", fn, f.Kind, HeldRelayDeadLetter, HeldDeadLetter, HeldLate)
	}
	for _, s := range f.Statuses {
		if !s.Valid() {
			return fmt.Errorf("admin.%s: HeldFilter.Statuses: %q is unknown: use %s, %s, %s or %s", fn, s, StatusHeld, StatusReplayRequested, StatusReplayed, StatusDiscarded)
		}
	}
	return nil
}
