package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
)

// parkedHelp is `eventline parked -h`.
const parkedHelp = `A consumer parks an event that arrives ahead of a missing earlier version of its
aggregate, and applies it once the missing version arrives. If it never will
(say, its dead letter was dropped), release the gap: the versions are recorded
as skipped and the consumer's sweeper applies what is parked. The sweeper also
does this by itself after the consumer's park timeout (1 hour by default).

An event whose version was given up on before it could be applied is late: it
is held for you (unless its consumer applies late events at once), with the
parked events that cannot be applied within the release-attempt limit. See
eventline held list -kind late, then held replay (applied late, the handler
told) or held discard.`

// parkedAggregate is an aggregate with parked events: its current (last
// applied) version, and the predecessor its lowest parked event waits for.
// Versions current+1..follows are missing when follows > current.
type parkedAggregate struct {
	key              store.Key
	current, follows int64
}

// parkedJSON is one parked event in `parked list -json`.
type parkedJSON struct {
	Group           string            `json:"group"`
	AggregateType   string            `json:"aggregate_type"`
	AggregateID     string            `json:"aggregate_id"`
	Version         int64             `json:"version"`
	PreviousVersion int64             `json:"previous_version"`
	CurrentVersion  int64             `json:"current_version"`
	EventID         string            `json:"event_id"`
	EventType       string            `json:"event_type"`
	Handler         string            `json:"handler"`
	Topic           string            `json:"topic"`
	ParkedAt        time.Time         `json:"parked_at"`
	ReleaseAttempts int               `json:"release_attempts"`
	LastError       string            `json:"last_error,omitempty"`
	LastAttemptAt   *time.Time        `json:"last_attempt_at,omitempty"`
	Metadata        map[string]string `json:"metadata"`
	// Payload is the event body when it is JSON; PayloadBase64 otherwise.
	Payload       json.RawMessage `json:"payload,omitempty"`
	PayloadBase64 []byte          `json:"payload_base64,omitempty"`
	// WaitingFor is where the aggregate's next missing version is; absent
	// when nothing is missing (or with -locate=false).
	WaitingFor *versionWhere `json:"waiting_for,omitempty"`
}

const parkedListHelp = `
Lists parked events by group, aggregate and version, with each aggregate's
current (last applied) version, so the missing versions are current+1 up to
the predecessor the lowest parked event follows. For each aggregate it says
where the next missing version is: dead-lettered by the group or by the relay
(eventline held), in the outbox not yet relayed, relayed, or nowhere. With
-brokers, a relayed version is looked up on Kafka too: its partition and
offset, and the group's committed offset there.`

func parkedList(ctx context.Context, inv *invocation) error {
	fs := inv.fs
	lf := addListFlags(inv, "most parked events to list", "print JSON (with payload and metadata) instead of a table")
	locate := fs.Bool("locate", true, "say where each aggregate's next missing version is: consumer or relay dead letters, the outbox (pending or relayed), or nowhere")
	outboxURL := fs.String("outbox-database-url", "", "PostgreSQL `URL` of the outbox's database, when it is not the consumer's (default -database-url)")
	outboxSchema := fs.String("outbox-schema", "", "`schema` of the outbox's tables (default -schema)")
	if err := lf.parse(); err != nil {
		return err
	}
	if *outboxSchema != "" {
		if err := sqlident.Validate("-outbox-schema", *outboxSchema); err != nil {
			return usageErrorf("%v", err)
		}
	}
	filter := store.ParkedFilter{Group: *lf.group, AggregateType: lf.aggregateType, AggregateID: lf.aggregateID, Limit: *lf.limit}
	st, pool, err := inv.versioning(ctx)
	if err != nil {
		return err
	}
	parked, err := st.ListParked(ctx, pool, filter)
	if err != nil {
		return err
	}
	// Each listed aggregate once, in list order, with its current version.
	// Its first parked event is its lowest: the one that waits.
	var aggs []parkedAggregate
	current := map[store.Key]int64{}
	for _, p := range parked {
		if _, seen := current[p.Key()]; seen {
			continue
		}
		v, err := st.Current(ctx, pool, p.Key())
		if err != nil {
			return err
		}
		current[p.Key()] = v
		aggs = append(aggs, parkedAggregate{key: p.Key(), current: v, follows: p.PreviousVersion})
	}
	var where map[store.Key]versionWhere
	if *locate {
		if where, err = inv.whereMissing(ctx, pool, aggs, *outboxURL, *outboxSchema); err != nil {
			return err
		}
	}
	toJSON := func(p store.Parked) parkedJSON {
		j := parkedJSON{
			Group: p.Group, AggregateType: p.AggregateType, AggregateID: p.AggregateID, Version: p.Version,
			PreviousVersion: p.PreviousVersion, CurrentVersion: current[p.Key()], EventID: p.EventID, EventType: p.EventType, Handler: p.Handler,
			Topic: p.Topic, ParkedAt: p.ParkedAt.UTC(), ReleaseAttempts: p.ReleaseAttempts, LastError: p.LastError,
			Metadata: p.Metadata,
		}
		if !p.LastAttemptAt.IsZero() {
			at := p.LastAttemptAt.UTC()
			j.LastAttemptAt = &at
		}
		j.Payload, j.PayloadBase64 = payloadJSON(p.Payload)
		if w, ok := where[p.Key()]; ok {
			j.WaitingFor = &w
		}
		return j
	}
	return inv.output(mapList(parked, toJSON), func(out io.Writer) error {
		if len(parked) == 0 {
			_, err := fmt.Fprintln(out, "no parked events")
			return err
		}
		tw := newTable(out)
		row(tw, "GROUP", "AGGREGATE", "VERSION", "CURRENT", "EVENT ID", "TYPE", "PARKED FOR", "ATTEMPTS", "LAST ERROR")
		now := time.Now()
		for _, p := range parked {
			row(tw, p.Group, aggregate(p.AggregateType, p.AggregateID), p.Version, current[p.Key()], p.EventID, p.EventType,
				age(now.Sub(p.ParkedAt)), p.ReleaseAttempts, orDash(truncate(p.LastError, 50)))
		}
		if err := inv.flushLimited(out, tw, len(parked)); err != nil {
			return err
		}
		fmt.Fprintln(out)
		for _, a := range aggs {
			k, cur, follows := a.key, a.current, a.follows
			name := aggregate(k.AggregateType, k.AggregateID)
			if follows <= cur {
				fmt.Fprintf(out, "%s %s: at version %d, nothing missing; the consumer's sweeper applies the parked events\n", k.Group, name, cur)
				continue
			}
			fmt.Fprintf(out, "%s %s: at version %d, waiting for %s; to give up on them: eventline parked release -reason '...' %s %s\n",
				k.Group, name, cur, versionRange(cur+1, follows), k.Group, name)
			if w, ok := where[k]; ok {
				fmt.Fprintf(out, "  version %d: %s: %s\n", w.Version, w.Location, w.Detail)
			}
		}
		return nil
	})
}

// versionRange formats from..to, or a single version.
func versionRange(from, to int64) string {
	if from == to {
		return fmt.Sprintf("version %d", from)
	}
	return fmt.Sprintf("versions %d..%d", from, to)
}

// versioning returns the version gate's store for -schema and a pool.
func (inv *invocation) versioning(ctx context.Context) (*store.Store, *pgxpool.Pool, error) {
	st, err := store.New(inv.globals.schema)
	if err != nil {
		return nil, nil, err
	}
	pool, err := inv.pool(ctx)
	return st, pool, err
}

const parkedReleaseHelp = `
Gives up on the versions missing in front of an aggregate's lowest parked
event: records them in skipped_versions with the reason, and moves the
aggregate's version to just below that event. It needs only the database and
runs no handler; the running consumer's sweeper applies the now-ready parked
events on its next pass. Parked events the aggregate has already passed move to
the late events. A version released here is not applied in order any more: if
it arrives later it is late (see eventline held list -kind late).`

func parkedRelease(ctx context.Context, inv *invocation) error {
	fs := inv.fs
	reason := fs.String("reason", "", "why the missing versions are given up (required; kept in the audit)")
	inv.jsonFlag("print the outcome as JSON")
	pos, err := inv.parse()
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		return usageErrorf("want exactly two arguments, <group> <aggregate_type>/<aggregate_id>, got %d", len(pos))
	}
	group := pos[0]
	typ, id, ok := parseAggregate(pos[1])
	if !ok {
		return usageErrorf("%q is not <aggregate_type>/<aggregate_id>, e.g. order/42", pos[1])
	}
	if strings.TrimSpace(*reason) == "" {
		return usageErrorf("-reason is required: say why the missing versions will never arrive (it is kept in skipped_versions)")
	}
	st, pool, err := inv.versioning(ctx)
	if err != nil {
		return err
	}
	rel, err := st.ReleaseGap(ctx, pool, group, typ, id, *reason)
	if errors.Is(err, store.ErrNothingParked) {
		msg := fmt.Sprintf("group %s has no parked events for %s/%s; nothing to release (eventline parked list -group %s)", group, typ, id, group)
		if rel.Late > 0 {
			msg += fmt.Sprintf("; %s the aggregate had already passed held as late (eventline held list -kind late)", plural(int64(rel.Late), "parked event"))
		}
		return errors.New(msg)
	}
	if err != nil {
		return err
	}
	outcome := struct {
		Group         string `json:"group"`
		AggregateType string `json:"aggregate_type"`
		AggregateID   string `json:"aggregate_id"`
		SkippedFrom   int64  `json:"skipped_from"`
		SkippedTo     int64  `json:"skipped_to"`
		Ready         int    `json:"ready"`
		Late          int    `json:"late"`
	}{group, typ, id, rel.From, rel.To, rel.Ready, rel.Late}
	return inv.output(outcome, func(out io.Writer) error {
		if rel.From == 0 && rel.To == 0 {
			fmt.Fprintf(out, "%s %s/%s: no versions were missing in front of the lowest parked event\n", group, typ, id)
		} else {
			fmt.Fprintf(out, "%s %s/%s: gave up on %s (recorded in skipped_versions)\n", group, typ, id, versionRange(rel.From, rel.To))
		}
		if rel.Late > 0 {
			fmt.Fprintf(out, "moved %s the aggregate had already passed as late (eventline held list -kind late)\n", plural(int64(rel.Late), "parked event"))
		}
		_, err := fmt.Fprintf(out, "%s now ready: the sweeper of a running %s consumer applies them on its next pass\n", plural(int64(rel.Ready), "parked event"), group)
		return err
	})
}

// skippedJSON is one audited gap in `parked skipped -json`.
type skippedJSON struct {
	ID            int64     `json:"id"`
	Group         string    `json:"group"`
	AggregateType string    `json:"aggregate_type"`
	AggregateID   string    `json:"aggregate_id"`
	From          int64     `json:"from_version"`
	To            int64     `json:"to_version"`
	Reason        string    `json:"reason"`
	SkippedAt     time.Time `json:"skipped_at"`
}

const parkedSkippedHelp = `
Lists the versions given up on, by the sweeper after the park timeout or by
'eventline parked release', oldest first.`

func parkedSkipped(ctx context.Context, inv *invocation) error {
	lf := addListFlags(inv, "most rows to list", "print JSON instead of a table")
	if err := lf.parse(); err != nil {
		return err
	}
	filter := store.SkippedFilter{Group: *lf.group, AggregateType: lf.aggregateType, AggregateID: lf.aggregateID, Limit: *lf.limit}
	st, pool, err := inv.versioning(ctx)
	if err != nil {
		return err
	}
	skipped, err := st.ListSkipped(ctx, pool, filter)
	if err != nil {
		return err
	}
	toJSON := func(s store.Skipped) skippedJSON {
		return skippedJSON{s.ID, s.Group, s.AggregateType, s.AggregateID, s.From, s.To, s.Reason, s.SkippedAt.UTC()}
	}
	return inv.output(mapList(skipped, toJSON), func(w io.Writer) error {
		if len(skipped) == 0 {
			_, err := fmt.Fprintln(w, "no skipped versions")
			return err
		}
		tw := newTable(w)
		row(tw, "ID", "GROUP", "AGGREGATE", "SKIPPED", "AT", "REASON")
		for _, s := range skipped {
			row(tw, s.ID, s.Group, aggregate(s.AggregateType, s.AggregateID), versionRange(s.From, s.To), timestamp(s.SkippedAt), truncate(s.Reason, 70))
		}
		return tw.Flush()
	})
}

// listFlags are the filters `parked list` and `parked skipped` share.
type listFlags struct {
	inv              *invocation
	group, aggregate *string
	limit            *int
	// aggregateType and aggregateID are -aggregate, parsed.
	aggregateType, aggregateID string
}

func addListFlags(inv *invocation, limitHelp, jsonHelp string) *listFlags {
	fs := inv.fs
	inv.jsonFlag(jsonHelp)
	return &listFlags{
		inv:       inv,
		group:     fs.String("group", "", "only this consumer group (default all groups)"),
		aggregate: fs.String("aggregate", "", "only this aggregate, as `TYPE/ID` (default all)"),
		limit:     inv.limitFlag(store.DefaultListLimit, limitHelp),
	}
}

// parse parses the arguments and checks the filters.
func (lf *listFlags) parse() error {
	inv := lf.inv
	pos, err := inv.parse()
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageErrorf("%s takes no arguments, got %q (filter with -group and -aggregate)", inv.path, pos)
	}
	lf.aggregateType, lf.aggregateID, err = aggregateFlag(*lf.aggregate)
	return err
}
