package verify

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// checkConsumerState reports parked events, skipped gaps, events applied
// out of order, consumer dead letters and the effects queries' findings.
func (r *runner) checkConsumerState(ctx context.Context, ctx1 pgx.Tx) error {
	for g := range r.cfg.EffectsQueries {
		if r.groups[g] == nil {
			r.note("group %s: has an effects query but was not checked (it has no records, or is not among the groups asked for)", g)
		}
	}
	groups := slices.Sorted(maps.Keys(r.groups))
	if len(groups) == 0 {
		return nil
	}
	err := r.consumer.readParked(ctx, ctx1, groups, r.w, func(group, typ, id, eventID, eventType string, version, follows int64, parkedAt time.Time, attempts int, lastErr string, current *int64) {
		gs := r.groups[group]
		age := max(r.consumerNow.Sub(parkedAt), 0)
		gs.rep.Parked++
		gs.rep.OldestParkedSeconds = max(gs.rep.OldestParkedSeconds, age.Seconds())
		cur := int64(0)
		if current != nil {
			cur = *current
		}
		detail := fmt.Sprintf("parked: the aggregate is at v%d and waits for v%d", cur, cur+1)
		if follows > cur+1 {
			detail = fmt.Sprintf("parked: the aggregate is at v%d and waits for v%d..v%d", cur, cur+1, follows)
		} else if follows <= cur {
			detail = fmt.Sprintf("parked: the aggregate is at v%d, which it follows: the consumer's sweeper applies it on its next pass", cur)
		}
		if attempts > 0 {
			detail += fmt.Sprintf("; releasing it failed %d time(s): %s", attempts, truncate(lastErr, maxReasonLength))
		}
		sev := Info
		if age > r.cfg.MaxParkedAge {
			sev = Problem
			detail += fmt.Sprintf(" (parked for longer than %s: is the consumer's sweeper running?)", human(r.cfg.MaxParkedAge))
		}
		at := parkedAt
		r.details.add(Finding{Severity: sev, Kind: Parked, Group: group, EventID: eventID, EventType: eventType,
			AggregateType: typ, AggregateID: id, AggregateVersion: version, At: &at, AgeSeconds: age.Seconds(), Detail: detail})
	})
	if err != nil {
		return err
	}
	err = r.consumer.readSkipped(ctx, ctx1, groups, r.w, func(group, typ, id string, from, to int64, reason string, at time.Time) {
		gs := r.groups[group]
		gs.rep.SkippedGaps++
		gs.rep.SkippedVersions += to - from + 1
		t := at
		r.details.add(Finding{Severity: Warning, Kind: Skipped, Group: group, AggregateType: typ, AggregateID: id,
			AggregateVersion: from, ToVersion: to, At: &t, AgeSeconds: max(r.consumerNow.Sub(at), 0).Seconds(),
			Detail: "versions given up on: " + truncate(reason, maxReasonLength)})
	})
	if err != nil {
		return err
	}
	late := func(group, typ, id, eventID, eventType string, version int64, kind, reason string, heldAt time.Time, requested bool) {
		gs := r.groups[group]
		gs.rep.LateHeld++
		detail := fmt.Sprintf("late (%s), held for the operator: %s; eventline held list -kind late, then held replay or held discard", kind, truncate(reason, maxReasonLength))
		if requested {
			detail = fmt.Sprintf("late (%s), its replay was requested; the consumer's sweeper applies it (is it running?): %s", kind, truncate(reason, maxReasonLength))
		}
		at := heldAt
		r.details.add(Finding{Severity: Warning, Kind: Late, Group: group, EventID: eventID, EventType: eventType,
			AggregateType: typ, AggregateID: id, AggregateVersion: version, At: &at, AgeSeconds: max(r.consumerNow.Sub(heldAt), 0).Seconds(), Detail: detail})
	}
	if err := r.consumer.readLate(ctx, ctx1, groups, r.w, late); err != nil {
		return err
	}
	// An effects query with an ordering column orders exactly; the
	// others' order is read from processed_events.
	var byRecords []string
	for _, g := range groups {
		if q, ok := r.cfg.EffectsQueries[g]; ok {
			if err := r.checkEffects(ctx, ctx1, r.groups[g], q); err != nil {
				return err
			}
		}
		if !r.groups[g].orderFromEffects {
			byRecords = append(byRecords, g)
		}
	}
	if err := r.checkConsumerDeadLetters(ctx, ctx1, groups); err != nil {
		return err
	}
	if err := r.checkDiscarded(ctx, ctx1, groups); err != nil {
		return err
	}
	if len(byRecords) == 0 {
		return nil
	}
	var (
		group, typ, id, eventID, eventType string
		version, before                    int64
		at                                 time.Time
	)
	return queryEach(ctx, ctx1, "check the order events were applied in", []any{&group, &typ, &id, &version, &eventID, &eventType, &at, &before}, func() {
		r.outOfOrder(r.groups[group], typ, id, version, eventID, eventType, at, before, "processed_at and by the transaction that applied it")
	}, r.consumer.outOfOrderSQL(), r.w.since, r.w.until, byRecords)
}

// checkConsumerDeadLetters reports the groups' dead letters neither
// replayed nor discarded (held_events of kind dead_letter).
func (r *runner) checkConsumerDeadLetters(ctx context.Context, ctx1 pgx.Tx, groups []string) error {
	for _, gs := range r.groups {
		gs.rep.DeadLetterSources = append(gs.rep.DeadLetterSources, ConsumerDeadLetterTable)
	}
	return r.consumer.readConsumerDeadLetters(ctx, ctx1, groups, r.w, func(d deadRecord) {
		gs := r.groups[d.group]
		if gs == nil {
			return
		}
		gs.rep.ConsumerDeadLetters++
		at := d.at
		detail := "dead-lettered by the group (held event " + strconv.FormatInt(d.id, 10) + "; eventline held replay)"
		if d.reason != "" {
			detail += ": " + truncate(d.reason, maxReasonLength)
		}
		r.details.add(Finding{Severity: Problem, Kind: DeadLetter, Group: d.group, EventID: d.eventID, EventType: d.eventType,
			AggregateType: d.aggregateType, AggregateID: d.aggregateID, AggregateVersion: d.version,
			At: &at, AgeSeconds: max(r.consumerNow.Sub(at), 0).Seconds(), Detail: detail})
	})
}

// checkDiscarded reports events a group discarded as stale because another
// event had been applied at their version. The gate's stale outcome is
// not trusted: an event is stale legitimately only when it is the one that
// holds its version (a redelivery whose dedup record expired).
func (r *runner) checkDiscarded(ctx context.Context, ctx1 pgx.Tx, groups []string) error {
	var (
		group, typ, id, eventID, eventType, other string
		version                                   int64
		at                                        time.Time
	)
	return queryEach(ctx, ctx1, "check stale events against the versions applied", []any{&group, &typ, &id, &version, &eventID, &eventType, &at, &other}, func() {
		gs := r.groups[group]
		gs.rep.Discarded++
		t := at
		r.details.add(Finding{Severity: Problem, Kind: Discarded, Group: group, EventID: eventID, EventType: eventType,
			AggregateType: typ, AggregateID: id, AggregateVersion: version, At: &t, AgeSeconds: max(r.consumerNow.Sub(at), 0).Seconds(),
			Detail: fmt.Sprintf("discarded as stale: the group had applied v%d of %s/%s from another event, %s, so this event's effect was never applied. "+
				"Two events claim one version: a producer's sequence fell behind what consumers had seen (after a failover that lost commits, run `eventline relay advance-sequences` before producers start); "+
				"re-publish this event if its effect is needed", version, typ, id, other)})
	}, r.consumer.discardedSQL(), r.w.since, r.w.until, groups)
}
