package verify

import (
	"context"
	"fmt"
	"maps"
	"slices"
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
	err = r.consumer.readLate(ctx, ctx1, groups, r.w, func(group, typ, id, eventID, eventType string, version int64, kind, reason string, heldAt time.Time, requested bool) {
		gs := r.groups[group]
		gs.rep.LateHeld++
		detail := fmt.Sprintf("late (%s), held for the operator: %s; eventline parked late, then apply-late or discard-late", kind, truncate(reason, maxReasonLength))
		if requested {
			detail = fmt.Sprintf("late (%s), its apply was requested; the consumer's sweeper applies it (is it running?): %s", kind, truncate(reason, maxReasonLength))
		}
		at := heldAt
		r.details.add(Finding{Severity: Warning, Kind: Late, Group: group, EventID: eventID, EventType: eventType,
			AggregateType: typ, AggregateID: id, AggregateVersion: version, At: &at, AgeSeconds: max(r.consumerNow.Sub(heldAt), 0).Seconds(), Detail: detail})
	})
	if err != nil {
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
	rows, err := ctx1.Query(ctx, r.consumer.outOfOrderSQL(), r.w.since, r.w.until, byRecords)
	if err != nil {
		return fmt.Errorf("check the order events were applied in: %w", err)
	}
	var (
		group, typ, id, eventID, eventType string
		version, before                    int64
		at                                 time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&group, &typ, &id, &version, &eventID, &eventType, &at, &before}, func() error {
		r.outOfOrder(r.groups[group], typ, id, version, eventID, eventType, at, before, "processed_at and by the transaction that applied it")
		return nil
	})
	if err != nil {
		return fmt.Errorf("check the order events were applied in: %w", err)
	}
	return nil
}

// checkConsumerDeadLetters reports the groups' dead letters not replayed:
// rows of ConsumerDeadLetterTable, and records of their dead-letter topics
// whose event the group has neither handled since nor given up on.
func (r *runner) checkConsumerDeadLetters(ctx context.Context, ctx1 pgx.Tx, groups []string) error {
	report := func(d deadRecord, source string) {
		gs := r.groups[d.group]
		if gs == nil {
			return
		}
		gs.rep.ConsumerDeadLetters++
		at := d.at
		detail := "dead-lettered by the group (" + source + ")"
		if d.reason != "" {
			detail += ": " + d.reason
		}
		r.details.add(Finding{Severity: Problem, Kind: DeadLetter, Group: d.group, EventID: d.eventID, EventType: d.eventType,
			AggregateType: d.aggregateType, AggregateID: d.aggregateID, AggregateVersion: d.version,
			At: &at, AgeSeconds: max(r.consumerNow.Sub(at), 0).Seconds(), Detail: detail})
	}
	if r.consumerDeadTable {
		for _, gs := range r.groups {
			gs.rep.DeadLetterSources = append(gs.rep.DeadLetterSources, ConsumerDeadLetterTable)
		}
		err := r.consumer.readConsumerDeadLetters(ctx, ctx1, groups, r.w, func(d deadRecord) {
			d.reason = truncate(d.reason, maxReasonLength)
			report(d, ConsumerDeadLetterTable)
		})
		if err != nil {
			return err
		}
	}
	if r.kafka == nil {
		return nil
	}
	for _, g := range groups {
		t := r.kafka.deadTopics[g]
		if t == "" {
			continue
		}
		gs := r.groups[g]
		gs.rep.DeadLetterSources = append(gs.rep.DeadLetterSources, "topic "+t)
		// One entry per event, in the window; the newest dead letter wins.
		latest := map[string]deadRecord{}
		for _, d := range r.kafka.dead[g] {
			d.group = g
			if (r.w.since != nil && d.at.Before(*r.w.since)) || (r.w.until != nil && !d.at.Before(*r.w.until)) {
				continue
			}
			if prev, ok := latest[d.eventID]; !ok || d.at.After(prev.at) {
				latest[d.eventID] = d
			}
		}
		pending := slices.Collect(maps.Values(latest))
		for len(pending) > 0 {
			chunk := pending[:min(len(pending), r.cfg.ChunkSize)]
			pending = pending[len(chunk):]
			ids, types, aggIDs, versions := make([]string, len(chunk)), make([]string, len(chunk)), make([]string, len(chunk)), make([]int64, len(chunk))
			byID := map[string]deadRecord{}
			for i, d := range chunk {
				ids[i], types[i], aggIDs[i], versions[i] = d.eventID, d.aggregateType, d.aggregateID, d.version
				byID[d.eventID] = d
			}
			rows, err := ctx1.Query(ctx, r.consumer.resolvedSQL(), g, ids, types, aggIDs, versions)
			if err != nil {
				return fmt.Errorf("look up the dead letters of group %q: %w", g, err)
			}
			var id string
			var resolved bool
			_, err = pgx.ForEachRow(rows, []any{&id, &resolved}, func() error {
				if !resolved {
					report(byID[id], "topic "+t)
				}
				return nil
			})
			if err != nil {
				return fmt.Errorf("look up the dead letters of group %q: %w", g, err)
			}
		}
	}
	return nil
}

// checkDiscarded reports events a group discarded as stale because another
// event had been applied at their version. The gate's stale outcome is
// not trusted: an event is stale legitimately only when it is the one that
// holds its version (a redelivery whose dedup record expired).
func (r *runner) checkDiscarded(ctx context.Context, ctx1 pgx.Tx, groups []string) error {
	rows, err := ctx1.Query(ctx, r.consumer.discardedSQL(), r.w.since, r.w.until, groups)
	if err != nil {
		return fmt.Errorf("check stale events against the versions applied: %w", err)
	}
	var (
		group, typ, id, eventID, eventType, other string
		version                                   int64
		at                                        time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&group, &typ, &id, &version, &eventID, &eventType, &at, &other}, func() error {
		gs := r.groups[group]
		gs.rep.Discarded++
		t := at
		r.details.add(Finding{Severity: Problem, Kind: Discarded, Group: group, EventID: eventID, EventType: eventType,
			AggregateType: typ, AggregateID: id, AggregateVersion: version, At: &t, AgeSeconds: max(r.consumerNow.Sub(at), 0).Seconds(),
			Detail: fmt.Sprintf("discarded as stale: the group had applied v%d of %s/%s from another event, %s, so this event's effect was never applied. "+
				"Two events claim one version: a producer's sequence fell behind what consumers had seen (after a failover that lost commits, run `eventline relay advance-sequences` before producers start); "+
				"re-publish this event if its effect is needed", version, typ, id, other)})
		return nil
	})
	if err != nil {
		return fmt.Errorf("check stale events against the versions applied: %w", err)
	}
	return nil
}
