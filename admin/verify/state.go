package verify

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/held"
)

// checkConsumerState reports parked events, skipped gaps, late events,
// the effects queries' findings, consumer dead letters (held_events of
// kind dead_letter neither replayed nor discarded), events discarded as
// stale while another held their version, and events applied out of
// order.
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
	err := each(ctx, ctx1, "read parked events", func(p parkedRow) {
		gs := r.groups[p.Group]
		age := max(r.consumerNow.Sub(p.At), 0)
		gs.rep.Parked++
		gs.rep.OldestParkedSeconds = max(gs.rep.OldestParkedSeconds, age.Seconds())
		cur := p.Current
		detail := fmt.Sprintf("parked: the aggregate is at v%d and waits for v%d", cur, cur+1)
		if p.Follows > cur+1 {
			detail = fmt.Sprintf("parked: the aggregate is at v%d and waits for v%d..v%d", cur, cur+1, p.Follows)
		} else if p.Follows <= cur {
			detail = fmt.Sprintf("parked: the aggregate is at v%d, which it follows: the consumer's sweeper applies it on its next pass", cur)
		}
		if p.Attempts > 0 {
			detail += fmt.Sprintf("; releasing it failed %d time(s): %s", p.Attempts, held.Truncate(p.LastError, maxReasonLength))
		}
		sev := Info
		if age > r.cfg.MaxParkedAge {
			sev = Problem
			detail += fmt.Sprintf(" (parked for longer than %s: is the consumer's sweeper running?)", human(r.cfg.MaxParkedAge))
		}
		r.details.add(p.finding(sev, Parked, r.consumerNow, detail))
	}, r.consumerSQL(parkedSQL), r.rep.Since, r.rep.Until, groups)
	if err != nil {
		return err
	}
	err = each(ctx, ctx1, "read skipped versions", func(sk skippedRow) {
		gs := r.groups[sk.Group]
		gs.rep.SkippedGaps++
		gs.rep.SkippedVersions += sk.To - sk.From + 1
		at := sk.At
		r.details.add(Finding{Severity: Warning, Kind: Skipped, Group: sk.Group, AggregateType: sk.AggregateType, AggregateID: sk.AggregateID,
			AggregateVersion: sk.From, ToVersion: sk.To, At: &at, AgeSeconds: max(r.consumerNow.Sub(at), 0).Seconds(),
			Detail: "versions given up on: " + held.Truncate(sk.Reason, maxReasonLength)})
	}, r.consumerSQL(skippedSQL), r.rep.Since, r.rep.Until, groups)
	if err != nil {
		return err
	}
	err = each(ctx, ctx1, "read late events", func(l heldRow) {
		r.groups[l.Group].rep.LateHeld++
		detail := fmt.Sprintf("late (%s), held for the operator: %s; eventline held list -kind late, then held replay or held discard", l.Cause, held.Truncate(l.Reason, maxReasonLength))
		if l.Requested {
			detail = fmt.Sprintf("late (%s), its replay was requested; the consumer's sweeper applies it (is it running?): %s", l.Cause, held.Truncate(l.Reason, maxReasonLength))
		}
		r.details.add(l.finding(Warning, Late, r.consumerNow, detail))
	}, r.consumerSQL(heldSQL("late", open)), r.rep.Since, r.rep.Until, groups)
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
	err = each(ctx, ctx1, "read the consumer dead letters", func(d heldRow) {
		r.groups[d.Group].rep.ConsumerDeadLetters++
		detail := "dead-lettered by the group (held event " + strconv.FormatInt(d.ID, 10) + "; eventline held replay)"
		if d.Reason != "" {
			detail += ": " + held.Truncate(d.Reason, maxReasonLength)
		}
		r.details.add(d.finding(Problem, DeadLetter, r.consumerNow, detail))
	}, r.consumerSQL(heldSQL("dead_letter", open)), r.rep.Since, r.rep.Until, groups)
	if err != nil {
		return err
	}
	err = each(ctx, ctx1, "check stale events against the versions applied", func(d versionRow[string]) {
		r.groups[d.Group].rep.Discarded++
		r.details.add(d.finding(Problem, Discarded, r.consumerNow, fmt.Sprintf("discarded as stale: the group had applied v%d of %s/%s from another event, %s, so this event's effect was never applied. "+
			"Two events claim one version: a producer's sequence fell behind what consumers had seen (after a failover that lost commits, run `eventline relay advance-sequences` before producers start); "+
			"re-publish this event if its effect is needed", d.Version, d.AggregateType, d.AggregateID, d.Other)))
	}, r.consumerSQL(discardedSQL), r.rep.Since, r.rep.Until, groups)
	if err != nil {
		return err
	}
	if len(byRecords) == 0 {
		return nil
	}
	return each(ctx, ctx1, "check the order events were applied in", func(o versionRow[int64]) {
		r.outOfOrder(r.groups[o.Group], o, "processed_at and by the transaction that applied it")
	}, r.consumerSQL(outOfOrderSQL), r.rep.Since, r.rep.Until, byRecords)
}
