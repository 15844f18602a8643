package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/eventline/eventline/admin"
)

// heldHelp is `eventline held -h`.
const heldHelp = `Held events wait for you, kept whole whatever their size, in one table
(held_events) with one life: held, replay_requested, then replayed; or
discarded, with a reason. Three kinds:

  relay_dead_letter  the relay gave up publishing an outbox row (Kafka refused
                     it for good, or every attempt failed). Replay re-enqueues
                     it into its outbox shard at once, same event id and
                     version; a running relay publishes it.
  dead_letter        a consumer group gave up on an event (it can never succeed
                     as it is, or its handler kept failing). Replay has a
                     running consumer of the group run it through its handler,
                     per aggregate in version order.
  late               a consumer group received an event its aggregate had
                     already passed. Replay has the group's running consumer
                     apply it late (the handler is told, middleware.IsLate).

Fix the cause first (deploy the handler, fix the data it needs), then replay;
or discard. A database outage never holds anything. Run held against the
database that holds the events: the producer's for relay dead letters, the
consumer's for the others.`

// heldFlags are the filters every held subcommand takes: -kind, -group,
// -aggregate and the held event ids; replay and discard add -all.
type heldFlags struct {
	inv                    *invocation
	kind, group, aggregate *string
	all                    *bool // nil for list
}

func addHeldFlags(inv *invocation, withAll bool) *heldFlags {
	fs := inv.fs
	hf := &heldFlags{
		inv:       inv,
		kind:      fs.String("kind", "", "only this kind: relay_dead_letter, dead_letter or late (default all)"),
		group:     fs.String("group", "", "only this consumer group (default all)"),
		aggregate: fs.String("aggregate", "", "only this aggregate, as `TYPE/ID` (default all)"),
	}
	if withAll {
		hf.all = fs.Bool("all", false, "every held event the filters select, instead of ids")
	}
	return hf
}

// parse parses the arguments and returns the held events they select: the
// ids given, within the filters. For replay and discard it wants ids, or
// -all with at least one filter, so -all never means everything by
// accident.
func (hf *heldFlags) parse() (admin.HeldFilter, error) {
	inv := hf.inv
	pos, err := inv.parse()
	if err != nil {
		return admin.HeldFilter{}, err
	}
	f := admin.HeldFilter{Kind: admin.HeldKind(*hf.kind), Group: *hf.group}
	switch f.Kind {
	case "", admin.HeldRelayDeadLetter, admin.HeldDeadLetter, admin.HeldLate:
	default:
		return f, usageErrorf("-kind %q: want relay_dead_letter, dead_letter or late", f.Kind)
	}
	if f.AggregateType, f.AggregateID, err = aggregateFlag(*hf.aggregate); err != nil {
		return f, err
	}
	for _, p := range pos {
		id, err := strconv.ParseInt(p, 10, 64)
		if err != nil || id < 1 {
			return f, usageErrorf("%q is not a held event id (a positive number from eventline held list)", p)
		}
		f.IDs = append(f.IDs, id)
	}
	slices.Sort(f.IDs)
	f.IDs = slices.Compact(f.IDs)
	switch all := hf.all != nil && *hf.all; {
	case hf.all == nil:
	case all && len(pos) > 0:
		return f, usageErrorf("give held event ids or -all, not both")
	case !all && len(pos) == 0:
		return f, usageErrorf("give the ids of the held events (see eventline held list), or -all with -kind, -group or -aggregate")
	case all && f.Kind == "" && f.Group == "" && f.AggregateType == "":
		return f, usageErrorf("-all needs -kind, -group or -aggregate: say which held events")
	}
	return f, nil
}

// heldJSON is one held event in `held list -json`.
type heldJSON struct {
	ID                int64      `json:"id"`
	Kind              string     `json:"kind"`
	Cause             string     `json:"cause"`
	Reason            string     `json:"reason"`
	Group             string     `json:"group,omitempty"`
	EventID           string     `json:"event_id"`
	EventType         string     `json:"event_type"`
	AggregateType     string     `json:"aggregate_type"`
	AggregateID       string     `json:"aggregate_id"`
	AggregateVersion  int64      `json:"aggregate_version"`
	PreviousVersion   int64      `json:"previous_version,omitempty"`
	CurrentVersion    int64      `json:"current_version_when_held,omitempty"`
	Topic             string     `json:"topic"`
	Handler           string     `json:"handler,omitempty"`
	MessageUUID       string     `json:"message_uuid"`
	Shard             *int       `json:"shard,omitempty"`
	Partition         *int32     `json:"partition,omitempty"`
	Offset            *int64     `json:"offset,omitempty"`
	HeldAt            time.Time  `json:"held_at"`
	Times             int        `json:"times_held"`
	Status            string     `json:"status"`
	ReplayRequestedAt *time.Time `json:"replay_requested_at,omitempty"`
	ReplayedAt        *time.Time `json:"replayed_at,omitempty"`
	Attempts          int        `json:"attempts"`
	LastError         string     `json:"last_error,omitempty"`
	NextAttemptAt     *time.Time `json:"next_attempt_at,omitempty"`
	DiscardedAt       *time.Time `json:"discarded_at,omitempty"`
	DiscardReason     string     `json:"discard_reason,omitempty"`
	// Metadata holds the headers that are text; BinaryMetadata the others,
	// base64-encoded, so nothing is altered.
	Metadata       map[string]string `json:"metadata"`
	BinaryMetadata []binaryHeader    `json:"binary_metadata,omitempty"`
	// Payload is the body when it is JSON; PayloadBase64 otherwise.
	Payload       json.RawMessage `json:"payload,omitempty"`
	PayloadBase64 []byte          `json:"payload_base64,omitempty"`
}

type binaryHeader struct {
	Key   []byte `json:"key_base64"`
	Value []byte `json:"value_base64"`
}

func isText(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

func heldToJSON(e admin.HeldEvent) heldJSON {
	j := heldJSON{
		ID: e.ID, Kind: string(e.Kind), Cause: e.Cause, Reason: e.Reason, Group: e.Group, EventID: e.EventID, EventType: e.EventType,
		AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.AggregateVersion,
		PreviousVersion: e.PreviousVersion, CurrentVersion: e.CurrentVersion, Topic: e.Topic, Handler: e.Handler,
		MessageUUID: e.MessageUUID, HeldAt: e.HeldAt.UTC(), Times: e.Times, Status: string(e.Status),
		ReplayRequestedAt: e.ReplayRequestedAt, ReplayedAt: e.ReplayedAt, Attempts: e.Attempts, LastError: e.LastError,
		NextAttemptAt: e.NextAttemptAt, DiscardedAt: e.DiscardedAt, DiscardReason: e.DiscardReason, Metadata: map[string]string{},
	}
	if e.Kind == admin.HeldRelayDeadLetter {
		shard := e.Shard
		j.Shard = &shard
	}
	if e.FromKafka {
		p, o := e.Partition, e.Offset
		j.Partition, j.Offset = &p, &o
	}
	keys := make([]string, 0, len(e.Metadata))
	for k := range e.Metadata {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if v := e.Metadata[k]; isText(k) && isText(v) {
			j.Metadata[k] = v
		} else {
			j.BinaryMetadata = append(j.BinaryMetadata, binaryHeader{Key: []byte(k), Value: []byte(v)})
		}
	}
	j.Payload, j.PayloadBase64 = payloadJSON(e.Payload)
	return j
}

// heldStatuses are the -status values of `held list`.
var heldStatuses = map[string][]admin.HeldStatus{
	"open":             {admin.StatusHeld, admin.StatusReplayRequested},
	"held":             {admin.StatusHeld},
	"replay_requested": {admin.StatusReplayRequested},
	"replayed":         {admin.StatusReplayed},
	"discarded":        {admin.StatusDiscarded},
	"all":              {admin.StatusHeld, admin.StatusReplayRequested, admin.StatusReplayed, admin.StatusDiscarded},
}

// defaultHeldLimit is the row limit of `held list`.
const defaultHeldLimit = 100

const heldListHelp = `
Lists held events, oldest first: by default those waiting for you or for their
replay (-status open). CAUSE says why each is held: for dead letters permanent,
retries_exhausted, failed, id_conflict, gap_too_large (the relay's: rejected,
retries_exhausted, malformed); for late events arrived_late (its version had
been given up on, see eventline parked skipped), passed (it was parked and the
aggregate moved past it), release_failed (it was parked and kept failing) or
version_conflict (a replayed dead letter whose version another event took
meanwhile). The table shortens the reason; -json shows everything, payload and
headers included (headers that are not text are base64-encoded, never
altered).`

func heldList(ctx context.Context, inv *invocation) error {
	hf := addHeldFlags(inv, false)
	status := inv.fs.String("status", "open", "open, held, replay_requested, replayed, discarded or all")
	limit := inv.limitFlag(defaultHeldLimit, "most held events to list")
	inv.jsonFlag("print JSON (with payload and headers) instead of a table")
	f, err := hf.parse()
	if err != nil {
		return err
	}
	var ok bool
	if f.Statuses, ok = heldStatuses[*status]; !ok {
		return usageErrorf("-status %q: want open, held, replay_requested, replayed, discarded or all", *status)
	}
	f.Limit = *limit
	pool, err := inv.pool(ctx)
	if err != nil {
		return err
	}
	list, err := admin.ListHeld(ctx, pool, inv.globals.schema, f)
	if err != nil {
		return err
	}
	return inv.output(mapList(list, heldToJSON), func(w io.Writer) error {
		if len(list) == 0 {
			_, err := fmt.Fprintf(w, "no held events (%s)\n", *status)
			return err
		}
		tw := newTable(w)
		row(tw, "ID", "KIND", "GROUP", "EVENT ID", "TYPE", "AGGREGATE", "VERSION", "CAUSE", "STATUS", "HELD AT", "ATTEMPTS", "REASON")
		for _, e := range list {
			version := "-"
			if e.AggregateVersion > 0 {
				version = strconv.FormatInt(e.AggregateVersion, 10)
			}
			reason := e.Reason
			if e.LastError != "" && e.Status == admin.StatusHeld && e.Kind != admin.HeldRelayDeadLetter && e.Cause != "release_failed" {
				reason = "replay failed: " + e.LastError
			}
			row(tw, e.ID, e.Kind, orDash(e.Group), orDash(truncate(e.EventID, 40)), orDash(truncate(e.EventType, 30)),
				truncate(aggregate(e.AggregateType, e.AggregateID), 40), version, e.Cause, e.Status, timestamp(e.HeldAt), e.Attempts, truncate(reason, 60))
		}
		return inv.flushLimited(w, tw, len(list))
	})
}

// aggregate formats an aggregate as type/id.
func aggregate(typ, id string) string {
	if typ == "" && id == "" {
		return "-"
	}
	return typ + "/" + id
}

const heldReplayHelp = `
Replays held events waiting for you (status held), per aggregate in version
order, in one transaction:

  relay_dead_letter  re-enqueued into its outbox shard now and marked
                     replayed; a running relay publishes it like a new event.
                     Consumers that parked later versions apply it in order if
                     it reaches them within their park timeout; a group that
                     already gave up on the version (eventline parked skipped)
                     holds it as late instead: replay warns about it.
  dead_letter, late  marked replay_requested; a running consumer of the group
                     replays them on its next sweep (every few seconds) and
                     marks them replayed. A dead letter goes through its
                     handler once; if it fails it is held again with the error
                     (held list shows it) and the later dead letters of its
                     aggregate wait with it; one whose version another event
                     took while it was held is held again as late
                     (version_conflict), never dropped. A late event is applied
                     late, the handler told; after the consumer's
                     release-attempt limit it is held again with its error.

A dead letter is not replayed while an earlier one of its aggregate is still
held: replay (or discard) them together.`

func heldReplay(ctx context.Context, inv *invocation) error {
	hf := addHeldFlags(inv, true)
	f, err := hf.parse()
	if err != nil {
		return err
	}
	pool, err := inv.pool(ctx)
	if err != nil {
		return err
	}
	res, err := admin.ReplayHeld(ctx, pool, inv.globals.schema, f)
	switch {
	case errors.Is(err, admin.ErrNoHeld) && *hf.all:
		fmt.Fprintln(inv.stdout, "no held events waiting for replay match")
		return nil
	case errors.Is(err, admin.ErrNoHeld):
		return errors.New("none of the ids given is a held event waiting for you (status held): unknown, or already replayed or discarded; see eventline held list -status all")
	}
	if err != nil {
		return err
	}
	out, warn := inv.stdout, inv.stderr
	for _, a := range res.ArrivesLate {
		fmt.Fprintf(warn, "warning: held event %d (event %s, %s/%s v%d): consumer group(s) %s already gave up on that version (eventline parked skipped); "+
			"the replayed event arrives late there and is held for you, not applied in order: eventline held list -kind late -group %s\n",
			a.ID, a.EventID, a.AggregateType, a.AggregateID, a.AggregateVersion, strings.Join(a.Groups, ", "), a.Groups[0])
	}
	if n := len(res.Enqueued); n > 0 {
		fmt.Fprintf(out, "re-enqueued %s: %s; a running relay publishes them again with the same event ids and aggregate versions\n",
			plural(int64(n), "relay dead letter"), joinIDs(res.Enqueued))
	}
	if n := len(res.Requested); n > 0 {
		fmt.Fprintf(out, "replay requested for %s: %s; a running consumer of each group replays them on its next sweep (follow them with eventline held list -status all)\n",
			plural(int64(n), "held event"), joinIDs(res.Requested))
	}
	if n, done := len(f.IDs), len(res.Enqueued)+len(res.Requested); n > done {
		fmt.Fprintf(out, "%d of the %d ids given were not waiting (unknown, or already replayed or discarded)\n", n-done, n)
	}
	return nil
}

const heldDiscardHelp = `
Gives up on held events waiting for you or for their replay: they stay listed,
marked discarded with the reason, and are never replayed. A discarded late
event's dedup record says late_discarded, so a redelivery is still a
duplicate. The versions of discarded dead letters stay missing: a consumer that
parked later versions of the aggregate applies them after its park timeout (or
at once with eventline parked release).`

func heldDiscard(ctx context.Context, inv *invocation) error {
	reason := inv.fs.String("reason", "", "why they are given up (required; kept for the audit)")
	hf := addHeldFlags(inv, true)
	f, err := hf.parse()
	if err != nil {
		return err
	}
	if strings.TrimSpace(*reason) == "" {
		return usageErrorf("-reason is required: say why these events are given up (it is kept with them)")
	}
	pool, err := inv.pool(ctx)
	if err != nil {
		return err
	}
	ids, err := admin.DiscardHeld(ctx, pool, inv.globals.schema, f, *reason)
	if errors.Is(err, admin.ErrNoHeld) {
		return errors.New("no open held event matched; see eventline held list -status all")
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(inv.stdout, "discarded %s: %s\n", plural(int64(len(ids)), "held event"), joinIDs(ids))
	return nil
}

func joinIDs(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, " ")
}
