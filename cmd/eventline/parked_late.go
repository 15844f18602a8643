package main

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/eventline/eventline/internal/store"
)

// lateJSON is one late event in `parked late -json`.
type lateJSON struct {
	Group            string            `json:"group"`
	AggregateType    string            `json:"aggregate_type"`
	AggregateID      string            `json:"aggregate_id"`
	Version          int64             `json:"version"`
	PreviousVersion  int64             `json:"previous_version"`
	CurrentVersion   int64             `json:"current_version_when_held"`
	EventID          string            `json:"event_id"`
	EventType        string            `json:"event_type"`
	Handler          string            `json:"handler"`
	Topic            string            `json:"topic"`
	Kind             string            `json:"kind"`
	Reason           string            `json:"reason"`
	HeldAt           time.Time         `json:"held_at"`
	ApplyRequestedAt *time.Time        `json:"apply_requested_at,omitempty"`
	Attempts         int               `json:"attempts"`
	LastError        string            `json:"last_error,omitempty"`
	Metadata         map[string]string `json:"metadata"`
	// Payload is the event body when it is JSON; PayloadBase64 otherwise.
	Payload       json.RawMessage `json:"payload,omitempty"`
	PayloadBase64 []byte          `json:"payload_base64,omitempty"`
}

// payloadJSON returns a payload for JSON output: as is when it is JSON,
// else base64.
func payloadJSON(p []byte) (json.RawMessage, []byte) {
	if json.Valid(p) {
		return p, nil
	}
	return nil, p
}

func parkedLate(ctx context.Context, args []string) error {
	fs := newFlagSet(ctx, "parked late", "[-group G] [-aggregate TYPE/ID] [-limit N] [-json]", `
Lists late events held for the operator: events received but never applied
whose aggregate has passed their version. KIND says how: arrived_late (the
version had been given up on, see eventline parked skipped, before the event
arrived), passed (it was parked and the aggregate moved past it) or
release_failed (it was parked and kept failing; its version was given up).
Apply them with 'eventline parked apply-late' (the handler is told they come
after later versions) or drop them with 'eventline parked discard-late'.`)
	lf := addListFlags(fs, "most late events to list", "print JSON (with payload and metadata) instead of a table")
	if err := lf.parse(fs, "parked late", args); err != nil {
		return err
	}
	st, pool, err := openVersioning(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	late, err := st.ListLate(ctx, pool, store.LateFilter{Group: lf.group, AggregateType: lf.aggregateType, AggregateID: lf.aggregateID, Limit: lf.limit})
	if err != nil {
		return err
	}
	out := stdout(ctx)
	if lf.asJSON {
		list := make([]lateJSON, 0, len(late))
		for _, l := range late {
			j := lateJSON{
				Group: l.Group, AggregateType: l.AggregateType, AggregateID: l.AggregateID, Version: l.Version,
				PreviousVersion: l.PreviousVersion, CurrentVersion: l.CurrentVersion, EventID: l.EventID, EventType: l.EventType,
				Handler: l.Handler, Topic: l.Topic, Kind: string(l.Kind), Reason: l.Reason, HeldAt: l.ParkedAt.UTC(),
				Attempts: l.ReleaseAttempts, LastError: l.LastError, Metadata: l.Metadata,
			}
			if !l.ApplyRequestedAt.IsZero() {
				at := l.ApplyRequestedAt.UTC()
				j.ApplyRequestedAt = &at
			}
			j.Payload, j.PayloadBase64 = payloadJSON(l.Payload)
			list = append(list, j)
		}
		return writeJSON(out, list)
	}
	if len(late) == 0 {
		fmt.Fprintln(out, "no late events")
		return nil
	}
	tw := newTable(out)
	row(tw, "GROUP", "AGGREGATE", "VERSION", "EVENT ID", "TYPE", "KIND", "HELD FOR", "APPLY", "ATTEMPTS", "REASON")
	now := time.Now()
	for _, l := range late {
		apply := "-"
		if !l.ApplyRequestedAt.IsZero() {
			apply = "requested"
		}
		reason := l.Reason
		if l.LastError != "" && l.Kind != store.LateReleaseFailed {
			reason = "last apply failed: " + l.LastError
		}
		row(tw, l.Group, aggregate(l.AggregateType, l.AggregateID), l.Version, l.EventID, l.EventType, string(l.Kind),
			age(now.Sub(l.ParkedAt)), apply, l.ReleaseAttempts, truncate(reason, 70))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(late) == lf.limit {
		fmt.Fprintf(out, "(first %d shown; raise -limit for more)\n", lf.limit)
	}
	fmt.Fprintln(out, "\napply: eventline parked apply-late <group> <event-id>...   discard: eventline parked discard-late <group> <event-id>...")
	return nil
}

// lateTargets parses `<group> <event-id>...` or `-aggregate TYPE/ID
// <group>` (every late event of the aggregate).
func lateTargets(ctx context.Context, fs *flagSet, agg string, pos []string, st *store.Store, db store.DBTX) (group string, ids []string, err error) {
	if len(pos) == 0 {
		return "", nil, fs.usageErrorf("name the consumer group and the late events' ids (see eventline parked late)")
	}
	group, ids = pos[0], pos[1:]
	switch {
	case agg == "" && len(ids) == 0:
		return "", nil, fs.usageErrorf("give the ids of the late events (see eventline parked late), or -aggregate TYPE/ID for all of an aggregate's")
	case agg != "" && len(ids) > 0:
		return "", nil, fs.usageErrorf("give late event ids or -aggregate, not both")
	case agg != "":
		typ, id, ok := parseAggregate(agg)
		if !ok {
			return "", nil, fs.usageErrorf("-aggregate %q: want TYPE/ID, e.g. order/42", agg)
		}
		late, err := st.ListLate(ctx, db, store.LateFilter{Group: group, AggregateType: typ, AggregateID: id, Limit: 100_000})
		if err != nil {
			return "", nil, err
		}
		for _, l := range late {
			ids = append(ids, l.EventID)
		}
		if len(ids) == 0 {
			return "", nil, fmt.Errorf("group %s holds no late events of %s (eventline parked late -group %s)", group, agg, group)
		}
	}
	return group, ids, nil
}

func parkedApplyLate(ctx context.Context, args []string) error {
	return lateAction(ctx, args, "parked apply-late", `
Asks the group's running consumer to apply late events: its sweeper applies each
on its next pass, in version order per aggregate, through the handler the event
arrived on, with the event marked late (middleware.IsLate), so the handler
knows later versions of the aggregate were applied before it. An applied event
leaves the late events (its outcome becomes late_applied). A handler that keeps
failing is retried with a backoff; after the release-attempt limit the request
is dropped and the event stays listed with its last error.`,
		(*store.Store).RequestLateApply,
		func(n int, group string) string {
			return fmt.Sprintf("%s to apply: the sweeper of a running %s consumer applies them on its next pass", plural(int64(n), "late event"), group)
		})
}

func parkedDiscardLate(ctx context.Context, args []string) error {
	return lateAction(ctx, args, "parked discard-late", `
Discards late events for good: they are deleted from the late events and never
applied; their dedup record keeps the outcome late_discarded, so a redelivery is
skipped as a duplicate.`,
		(*store.Store).DiscardLate,
		func(n int, group string) string {
			return fmt.Sprintf("discarded %s of group %s", plural(int64(n), "late event"), group)
		})
}

// lateAction is a parked subcommand that acts on late events named by id,
// or on every late event of one aggregate: act does it and returns how
// many it reached, done says so.
func lateAction(ctx context.Context, args []string, name, help string,
	act func(*store.Store, context.Context, store.DBTX, string, ...string) (int, error),
	done func(n int, group string) string,
) error {
	fs := newFlagSet(ctx, name, "<group> <event-id>... | -aggregate TYPE/ID <group>", help)
	agg := fs.String("aggregate", "", "every late event of this aggregate, as `TYPE/ID`")
	pos, err := fs.parse(args)
	if err != nil {
		return err
	}
	st, pool, err := openVersioning(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	group, ids, err := lateTargets(ctx, fs, *agg, pos, st, pool)
	if err != nil {
		return err
	}
	n, err := act(st, ctx, pool, group, ids...)
	if err != nil {
		return err
	}
	out := stdout(ctx)
	fmt.Fprintln(out, done(n, group))
	if n < len(ids) {
		fmt.Fprintf(out, "%d of the %d ids given are not late events of group %s (see eventline parked late -group %s)\n", len(ids)-n, len(ids), group, group)
	}
	return nil
}
