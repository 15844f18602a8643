package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/dedup"
)

func init() {
	register(command{name: "consumer-dlq", summary: "List, replay and discard consumers' dead letters (list|replay|discard)", run: runConsumerDLQ})
}

func runConsumerDLQ(ctx context.Context, args []string) error {
	return dispatch(ctx, "consumer-dlq", `Consumer dead letters are events a consumer group gave up on: they can never
succeed as they are (they do not decode, no handler knows their type…) or their
handler kept failing until the retry budget ran out. They are kept whole in the
consumer's database (consumer_dead_letters), whatever their size. A database
outage never dead-letters anything. Fix the cause (deploy the handler, fix the
data it needs), then replay them: a running consumer of the group runs them
through their handler, per aggregate in version order, and the versions parked
behind them follow. Or discard them, with a reason.`, args, []subcommand{
		{"list", "List dead letters, oldest first", consumerDLQList},
		{"replay", "Ask the group's running consumer to replay dead letters", consumerDLQReplay},
		{"discard", "Give up on dead letters, with a reason", consumerDLQDiscard},
	})
}

// consumerDeadLetterJSON is one dead letter in `consumer-dlq list -json`.
type consumerDeadLetterJSON struct {
	ID                int64      `json:"id"`
	Group             string     `json:"group"`
	Topic             string     `json:"topic"`
	Handler           string     `json:"handler"`
	Partition         *int32     `json:"partition,omitempty"`
	Offset            *int64     `json:"offset,omitempty"`
	EventID           string     `json:"event_id"`
	EventType         string     `json:"event_type"`
	AggregateType     string     `json:"aggregate_type"`
	AggregateID       string     `json:"aggregate_id"`
	AggregateVersion  int64      `json:"aggregate_version"`
	Kind              string     `json:"kind"`
	Reason            string     `json:"reason"`
	DeadAt            time.Time  `json:"dead_at"`
	Times             int        `json:"times_dead"`
	Status            string     `json:"status"`
	ReplayRequestedAt *time.Time `json:"replay_requested_at,omitempty"`
	ReplayedAt        *time.Time `json:"replayed_at,omitempty"`
	ReplayAttempts    int        `json:"replay_attempts"`
	LastReplayError   string     `json:"last_replay_error,omitempty"`
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

func consumerDeadLetterToJSON(d dedup.DeadLetter) consumerDeadLetterJSON {
	j := consumerDeadLetterJSON{
		ID: d.ID, Group: d.Group, Topic: d.Topic, Handler: d.Handler, EventID: d.EventID, EventType: d.EventType,
		AggregateType: d.AggregateType, AggregateID: d.AggregateID, AggregateVersion: d.AggregateVersion,
		Kind: d.Kind, Reason: d.Reason, DeadAt: d.DeadAt.UTC(), Times: d.Times, Status: string(d.Status),
		ReplayRequestedAt: d.ReplayRequestedAt, ReplayedAt: d.ReplayedAt, ReplayAttempts: d.ReplayAttempts,
		LastReplayError: d.LastReplayError, DiscardedAt: d.DiscardedAt, DiscardReason: d.DiscardReason,
		Metadata: map[string]string{},
	}
	if d.FromKafka {
		p, o := d.Partition, d.Offset
		j.Partition, j.Offset = &p, &o
	}
	keys := make([]string, 0, len(d.Metadata))
	for k := range d.Metadata {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if v := d.Metadata[k]; isText(k) && isText(v) {
			j.Metadata[k] = v
		} else {
			j.BinaryMetadata = append(j.BinaryMetadata, binaryHeader{Key: []byte(k), Value: []byte(v)})
		}
	}
	if len(d.Payload) > 0 && json.Valid(d.Payload) {
		j.Payload = d.Payload
	} else {
		j.PayloadBase64 = d.Payload
	}
	return j
}

var consumerDLQStatuses = map[string][]dedup.DeadLetterStatus{
	"unresolved":       {dedup.StatusDead, dedup.StatusReplayRequested},
	"dead":             {dedup.StatusDead},
	"replay_requested": {dedup.StatusReplayRequested},
	"replayed":         {dedup.StatusReplayed},
	"discarded":        {dedup.StatusDiscarded},
	"all":              {dedup.StatusDead, dedup.StatusReplayRequested, dedup.StatusReplayed, dedup.StatusDiscarded},
}

func consumerDLQList(ctx context.Context, args []string) error {
	fs := newFlagSet(ctx, "consumer-dlq list", "[-group G] [-aggregate TYPE/ID] [-status S] [-limit N] [-json]", `
Lists consumer dead letters, oldest first: by default those waiting for an
operator or for their replay. The table shortens the reason; -json shows
everything, payload and headers included (headers that are not text are
base64-encoded, never altered).`)
	lf := addListFlags(fs, "most dead letters to list", "print JSON (with payload and headers) instead of a table")
	status := fs.String("status", "unresolved", "unresolved, dead, replay_requested, replayed, discarded or all")
	if err := lf.parse(fs, "consumer-dlq list", args); err != nil {
		return err
	}
	statuses, ok := consumerDLQStatuses[*status]
	if !ok {
		return fs.usageErrorf("-status %q: want unresolved, dead, replay_requested, replayed, discarded or all", *status)
	}
	store, pool, err := openDeadLetters(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	dls, err := store.List(ctx, pool, dedup.DeadLetterFilter{Group: lf.group, AggregateType: lf.aggregateType, AggregateID: lf.aggregateID,
		Statuses: statuses, Limit: lf.limit})
	if err != nil {
		return err
	}
	out := stdout(ctx)
	if lf.asJSON {
		list := make([]consumerDeadLetterJSON, 0, len(dls))
		for _, d := range dls {
			list = append(list, consumerDeadLetterToJSON(d))
		}
		return writeJSON(out, list)
	}
	if len(dls) == 0 {
		fmt.Fprintf(out, "no consumer dead letters (%s)\n", *status)
		return nil
	}
	tw := newTable(out)
	row(tw, "ID", "GROUP", "EVENT ID", "TYPE", "AGGREGATE", "VERSION", "KIND", "STATUS", "DEAD AT", "REASON")
	for _, d := range dls {
		version := "-"
		if d.AggregateVersion > 0 {
			version = strconv.FormatInt(d.AggregateVersion, 10)
		}
		reason := d.Reason
		if d.LastReplayError != "" && d.Status == dedup.StatusDead {
			reason = "replay failed: " + d.LastReplayError
		}
		row(tw, d.ID, d.Group, orDash(truncate(d.EventID, 40)), orDash(truncate(d.EventType, 30)),
			truncate(aggregate(d.AggregateType, d.AggregateID), 40), version, d.Kind, d.Status, timestamp(d.DeadAt), truncate(reason, 60))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(dls) == lf.limit {
		fmt.Fprintf(out, "(first %d shown; raise -limit for more)\n", lf.limit)
	}
	return nil
}

// dlqSelection is the dead letters a replay or discard applies to: ids, or
// -all within the -group and -aggregate filters.
type dlqSelection struct {
	filter dedup.DeadLetterFilter
	all    bool
}

func parseDLQSelection(fs *flagSet, args []string) (dlqSelection, error) {
	group := fs.String("group", "", "only this consumer group")
	agg := fs.String("aggregate", "", "only this aggregate, as `TYPE/ID`")
	all := fs.Bool("all", false, "every dead letter the filters select, instead of ids")
	pos, err := fs.parse(args)
	if err != nil {
		return dlqSelection{}, err
	}
	sel := dlqSelection{all: *all, filter: dedup.DeadLetterFilter{Group: *group}}
	if *agg != "" {
		var ok bool
		if sel.filter.AggregateType, sel.filter.AggregateID, ok = parseAggregate(*agg); !ok {
			return sel, fs.usageErrorf("-aggregate %q: want TYPE/ID, e.g. order/42", *agg)
		}
	}
	switch {
	case *all && len(pos) > 0:
		return sel, fs.usageErrorf("give dead letter ids or -all, not both")
	case !*all && len(pos) == 0:
		return sel, fs.usageErrorf("give the ids of the dead letters (see eventline consumer-dlq list), or -all with -group or -aggregate")
	case *all && *group == "" && *agg == "":
		return sel, fs.usageErrorf("-all needs -group or -aggregate: say whose dead letters")
	}
	for _, p := range pos {
		id, err := strconv.ParseInt(p, 10, 64)
		if err != nil || id < 1 {
			return sel, fs.usageErrorf("%q is not a dead letter id (a positive number from eventline consumer-dlq list)", p)
		}
		sel.filter.IDs = append(sel.filter.IDs, id)
	}
	return sel, nil
}

func consumerDLQReplay(ctx context.Context, args []string) error {
	fs := newFlagSet(ctx, "consumer-dlq replay", "[-group G] [-aggregate TYPE/ID] (<id>... | -all)", `
Asks for a replay of dead letters that wait for an operator. A running
consumer of each one's group picks them up on its next sweep (every few
seconds), runs each once through the handler it arrived on, per aggregate in
version order, and marks it replayed; a replay that fails puts the dead
letter back, with the error (consumer-dlq list shows it), and holds back the
later dead letters of its aggregate. A dead letter is not replayed while an
earlier one of its aggregate is still dead: replay (or discard) them
together. Replaying an event that was applied in the meantime does nothing
(the dedup record recognises it).`)
	sel, err := parseDLQSelection(fs, args)
	if err != nil {
		return err
	}
	store, pool, err := openDeadLetters(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	ids, err := store.RequestReplay(ctx, pool, sel.filter)
	if errors.Is(err, dedup.ErrNoDeadLetters) {
		return errors.New("no dead letter matched that waits for an operator (status dead); see eventline consumer-dlq list -status all")
	}
	if err != nil {
		return err
	}
	out := stdout(ctx)
	fmt.Fprintf(out, "replay requested for %s: %s\n", plural(int64(len(ids)), "dead letter"), joinIDs(ids))
	fmt.Fprintln(out, "a running consumer of the group replays them on its next sweep; follow them with eventline consumer-dlq list -status all")
	if n := len(sel.filter.IDs); n > len(ids) {
		fmt.Fprintf(out, "%d of the %d ids given were not waiting (unknown, or already replayed or discarded)\n", n-len(ids), n)
	}
	return nil
}

func consumerDLQDiscard(ctx context.Context, args []string) error {
	fs := newFlagSet(ctx, "consumer-dlq discard", "-reason TEXT [-group G] [-aggregate TYPE/ID] (<id>... | -all)", `
Gives up on dead letters: they stay in the table, marked discarded with the
reason, and are never replayed. Their versions stay missing: a consumer that
parked later versions of the aggregate applies them after its park timeout
(or at once with eventline parked release).`)
	reason := fs.String("reason", "", "why they are given up (required; kept for the audit)")
	sel, err := parseDLQSelection(fs, args)
	if err != nil {
		return err
	}
	if strings.TrimSpace(*reason) == "" {
		return fs.usageErrorf("-reason is required: say why these events are given up (it is kept with them)")
	}
	store, pool, err := openDeadLetters(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	ids, err := store.Discard(ctx, pool, sel.filter, *reason)
	if errors.Is(err, dedup.ErrNoDeadLetters) {
		return errors.New("no unresolved dead letter matched; see eventline consumer-dlq list -status all")
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout(ctx), "discarded %s: %s\n", plural(int64(len(ids)), "dead letter"), joinIDs(ids))
	return nil
}

// openDeadLetters opens the consumer dead-letter store of the -schema flag
// and a small pool on the -database-url one.
func openDeadLetters(ctx context.Context) (*dedup.DeadLetterStore, *pgxpool.Pool, error) {
	store, err := dedup.NewDeadLetterStore(globalsOf(ctx).schema)
	if err != nil {
		return nil, nil, err
	}
	pool, err := openPool(ctx, 2)
	if err != nil {
		return nil, nil, err
	}
	return store, pool, nil
}
