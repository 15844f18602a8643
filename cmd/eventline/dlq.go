package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/pgerr"
	"github.com/eventline/eventline/versioning"
)

func init() {
	register(command{name: "dlq", summary: "List and replay the relay's dead letters (list|replay)", run: runDLQ})
}

// defaultDLQLimit is the row limit of `dlq list`.
const defaultDLQLimit = 100

func runDLQ(ctx context.Context, args []string) error {
	return dispatch(ctx, "dlq", `Dead letters are outbox events the relay gave up on after -max-attempts failed
publishes (or at once, when Kafka rejects them for good). Fix the cause, then
replay them: they go back into their outbox shard with the same event id and
aggregate version, and consumers that parked later versions apply them in order
if the replay reaches them within their park timeout (1 hour by default). After
it a consumer has given up on the version (eventline parked skipped): the replay
arrives late and is held there (eventline parked late); replay warns about it.`, args, []subcommand{
		{"list", "List dead letters, oldest first", dlqList},
		{"replay", "Put dead letters back into the outbox for the relay", dlqReplay},
	})
}

// deadLetterJSON is one dead letter in `dlq list -json`.
type deadLetterJSON struct {
	ID               int64      `json:"id"`
	Shard            int        `json:"shard"`
	OutboxUUID       string     `json:"outbox_uuid"`
	EventID          string     `json:"event_id"`
	EventType        string     `json:"event_type"`
	AggregateType    string     `json:"aggregate_type"`
	AggregateID      string     `json:"aggregate_id"`
	AggregateVersion int64      `json:"aggregate_version"`
	Topic            string     `json:"topic"`
	Attempts         int        `json:"attempts"`
	LastError        string     `json:"last_error"`
	Reason           string     `json:"reason"`
	DeadAt           time.Time  `json:"dead_at"`
	ReplayedAt       *time.Time `json:"replayed_at"`
}

func dlqList(ctx context.Context, args []string) error {
	fs := newFlagSet(ctx, "dlq list", "[-all] [-limit N] [-json]", `
Lists dead letters not yet replayed, oldest first. The table shortens the
reason; -json shows it in full with the last publish error.`)
	all := fs.Bool("all", false, "include dead letters already replayed")
	limit := fs.Int("limit", defaultDLQLimit, "most dead letters to list")
	asJSON := fs.Bool("json", false, "print JSON instead of a table")
	pos, err := fs.parse(args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return fs.usageErrorf("dlq list takes no arguments, got %q", pos)
	}
	if *limit < 1 {
		return fs.usageErrorf("-limit must be at least 1, got %d", *limit)
	}
	g := globalsOf(ctx)
	pool, err := openPool(ctx, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	dls, err := admin.ListDeadLetters(ctx, pool, g.schema, admin.DeadLetterFilter{IncludeReplayed: *all, Limit: *limit})
	if err != nil {
		return err
	}
	out := stdout(ctx)
	if *asJSON {
		list := make([]deadLetterJSON, 0, len(dls))
		for _, d := range dls {
			list = append(list, deadLetterJSON{
				ID: d.ID, Shard: d.Shard, OutboxUUID: d.OutboxUUID, EventID: d.EventID, EventType: d.EventType,
				AggregateType: d.AggregateType, AggregateID: d.AggregateID, AggregateVersion: d.AggregateVersion,
				Topic: d.Topic, Attempts: d.Attempts, LastError: d.LastError, Reason: d.Reason,
				DeadAt: d.DeadAt.UTC(), ReplayedAt: d.ReplayedAt,
			})
		}
		return writeJSON(out, list)
	}
	if len(dls) == 0 {
		if *all {
			fmt.Fprintln(out, "no dead letters")
		} else {
			fmt.Fprintln(out, "no dead letters waiting for replay (-all lists replayed ones too)")
		}
		return nil
	}
	tw := newTable(out)
	head := []any{"ID", "SHARD", "EVENT ID", "TYPE", "AGGREGATE", "VERSION", "TOPIC", "ATTEMPTS", "DEAD AT", "REASON"}
	if *all {
		head = append(head, "REPLAYED AT")
	}
	row(tw, head...)
	for _, d := range dls {
		cols := []any{d.ID, d.Shard, orDash(d.EventID), orDash(d.EventType), aggregate(d.AggregateType, d.AggregateID),
			d.AggregateVersion, orDash(d.Topic), d.Attempts, timestamp(d.DeadAt), truncate(d.Reason, 60)}
		if *all {
			at := "-"
			if d.ReplayedAt != nil {
				at = timestamp(*d.ReplayedAt)
			}
			cols = append(cols, at)
		}
		row(tw, cols...)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(dls) == *limit {
		fmt.Fprintf(out, "(first %d shown; raise -limit for more)\n", *limit)
	}
	return nil
}

// aggregate formats an aggregate as type/id.
func aggregate(typ, id string) string {
	if typ == "" && id == "" {
		return "-"
	}
	return typ + "/" + id
}

func dlqReplay(ctx context.Context, args []string) error {
	fs := newFlagSet(ctx, "dlq replay", "<id>... | -all", `
Re-enqueues dead letters into their outbox shard, in the order they died, in
one transaction, and marks them replayed; a running relay then publishes them
like new events, with the same event id and aggregate version. A dead letter is
replayed at most once. Take the ids from 'eventline dlq list'.`)
	all := fs.Bool("all", false, "replay every dead letter not yet replayed")
	pos, err := fs.parse(args)
	if err != nil {
		return err
	}
	switch {
	case *all && len(pos) > 0:
		return fs.usageErrorf("give dead letter ids or -all, not both")
	case !*all && len(pos) == 0:
		return fs.usageErrorf("give the ids of the dead letters to replay (see eventline dlq list), or -all")
	}
	ids := make([]int64, 0, len(pos))
	for _, p := range pos {
		id, err := strconv.ParseInt(p, 10, 64)
		if err != nil || id < 1 {
			return fs.usageErrorf("%q is not a dead letter id (a positive number from eventline dlq list)", p)
		}
		ids = append(ids, id)
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)
	g := globalsOf(ctx)
	pool, err := openPool(ctx, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := warnSkipped(ctx, pool, g.schema, ids); err != nil {
		return err
	}
	n, err := admin.ReplayDeadLetters(ctx, pool, g.schema, ids...)
	switch {
	case errors.Is(err, admin.ErrNoDeadLetters) && *all:
		fmt.Fprintln(stdout(ctx), "no dead letters waiting for replay")
		return nil
	case errors.Is(err, admin.ErrNoDeadLetters):
		return fmt.Errorf("none of the ids %v is a dead letter waiting for replay; they do not exist or were replayed already (eventline dlq list -all)", ids)
	case err != nil:
		return err
	}
	out := stdout(ctx)
	fmt.Fprintf(out, "replayed %s: a running relay publishes them again with the same event ids and aggregate versions\n", plural(int64(n), "dead letter"))
	if !*all && n < len(ids) {
		fmt.Fprintf(out, "%d of the %d ids given were not waiting for replay (unknown or already replayed; see eventline dlq list -all)\n", len(ids)-n, len(ids))
	}
	return nil
}

// maxReplayCheck bounds the dead letters warnSkipped looks at.
const maxReplayCheck = 100_000

// warnSkipped warns, before dead letters are replayed, about every consumer
// group (with its tables in this database and schema) that already gave up
// on a replayed event's aggregate version: there the replay arrives late
// and is held for the operator instead of being applied in order. ids
// empty means every dead letter waiting for replay.
func warnSkipped(ctx context.Context, pool *pgxpool.Pool, schema string, ids []int64) error {
	dls, err := admin.ListDeadLetters(ctx, pool, schema, admin.DeadLetterFilter{Limit: maxReplayCheck})
	if err != nil {
		return err
	}
	store, err := versioning.NewStore(schema)
	if err != nil {
		return err
	}
	w := stderr(ctx)
	for _, d := range dls {
		if d.AggregateVersion <= 0 || (len(ids) > 0 && !slices.Contains(ids, d.ID)) {
			continue
		}
		groups, err := store.GroupsThatSkipped(ctx, pool, d.AggregateType, d.AggregateID, d.AggregateVersion)
		if pgerr.HasCode(err, pgerr.UndefinedTable) { // no consumer tables in this schema
			fmt.Fprintf(w, "note: no consumer tables in schema %s; consumer groups whose tables live elsewhere were not checked for skipped versions\n", schema)
			return nil
		}
		if err != nil {
			return err
		}
		if len(groups) == 0 {
			continue
		}
		fmt.Fprintf(w, "warning: dead letter %d (event %s, %s/%s v%d): consumer group(s) %s already gave up on that version (eventline parked skipped); "+
			"the replayed event arrives late there and is held for you, not applied in order: list it with eventline parked late -group %s, "+
			"then eventline parked apply-late %s %s (or discard-late)\n",
			d.ID, d.EventID, d.AggregateType, d.AggregateID, d.AggregateVersion, strings.Join(groups, ", "), groups[0], groups[0], d.EventID)
	}
	return nil
}
