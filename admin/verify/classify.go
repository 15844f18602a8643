package verify

import (
	"context"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/held"
)

// classifySQL joins an events relation (eventsSQL, of outboxEvent)
// with the consumer groups' records. Parameters $p and $p+1 are parallel
// arrays of (group, topic) pairs: an event is expected by the groups that
// consume its topic.
//
// One aggregation does the anti-join and the counting in a single pass:
// rows a group has a record of collapse into one row per group and
// outcome (counted, first column true, the event's columns zero); the
// events it has no record of stay one row each, with the group's version
// of the aggregate, whether a skipped range covers the event's version,
// and whether the group dead-lettered it. Only those rows reach Go.
func classifySQL(eventsSQL string, p int) string {
	g, t := "$"+strconv.Itoa(p), "$"+strconv.Itoa(p+1)
	return `SELECT a.outcome IS NOT NULL, a.grp, COALESCE(a.outcome, ''), a.n, a.event_id, a.event_type, a.topic, a.aggregate_type,
		a.aggregate_id, a.version, a.created_at, a.relayed, a.dead, a.retry_attempts, a.retry_error, av.version,
		a.outcome IS NULL AND a.version > 0 AND EXISTS (SELECT 1 FROM {schema}.skipped_versions sv WHERE sv.consumer_group = a.grp
			AND sv.aggregate_type = a.aggregate_type AND sv.aggregate_id = a.aggregate_id
			AND a.version BETWEEN sv.from_version AND sv.to_version),
		a.outcome IS NULL AND EXISTS (SELECT 1 FROM {schema}.held_events c
			WHERE c.kind = 'dead_letter' AND c.consumer_group = a.grp AND c.event_id = a.event_id AND c.aggregate_type = a.aggregate_type
				AND c.aggregate_id = a.aggregate_id AND c.status <> 'replayed')
	FROM (
		SELECT gt.grp, p.outcome, count(*)::bigint AS n, u.*
		FROM (` + eventsSQL + `) ev
		JOIN unnest(` + g + `::text[], ` + t + `::text[]) AS gt(grp, topic) ON gt.topic = ev.topic
		LEFT JOIN {schema}.processed_events p ON p.consumer_group = gt.grp AND p.event_id = ev.event_id
			AND p.aggregate_type = ev.aggregate_type AND p.aggregate_id = ev.aggregate_id
		CROSS JOIN LATERAL (SELECT
			CASE WHEN p.event_id IS NULL THEN ev.event_id ELSE '' END AS event_id,
			CASE WHEN p.event_id IS NULL THEN ev.event_type ELSE '' END AS event_type,
			CASE WHEN p.event_id IS NULL THEN ev.topic ELSE '' END AS topic,
			CASE WHEN p.event_id IS NULL THEN ev.aggregate_type ELSE '' END AS aggregate_type,
			CASE WHEN p.event_id IS NULL THEN ev.aggregate_id ELSE '' END AS aggregate_id,
			CASE WHEN p.event_id IS NULL THEN ev.version ELSE 0 END AS version,
			CASE WHEN p.event_id IS NULL THEN ev.created_at ELSE 'epoch' END AS created_at,
			p.event_id IS NULL AND ev.relayed AS relayed,
			p.event_id IS NULL AND ev.dead AS dead,
			CASE WHEN p.event_id IS NULL THEN ev.retry_attempts ELSE 0 END AS retry_attempts,
			CASE WHEN p.event_id IS NULL THEN ev.retry_error ELSE '' END AS retry_error) u
		GROUP BY gt.grp, p.outcome, u.event_id, u.event_type, u.Topic, u.aggregate_type, u.aggregate_id, u.Version,
			u.created_at, u.Relayed, u.Dead, u.retry_attempts, u.retry_error
	) a
	LEFT JOIN {schema}.aggregate_versions av ON a.outcome IS NULL AND av.consumer_group = a.grp
		AND av.aggregate_type = a.aggregate_type AND av.aggregate_id = a.aggregate_id`
}

// classified is a row of classifySQL: a count of the group's events of
// one outcome (Counted), or an event it has no record of.
type classified struct {
	Counted bool
	Group   string
	Outcome string
	N       int64
	outboxEvent
	GroupVersion          *int64
	Skipped, ConsumerDead bool
}

// classify runs a classification query and feeds its rows to the runner.
func (r *runner) classify(ctx context.Context, tx pgx.Tx, query string, args ...any) error {
	return each(ctx, tx, "match outbox events with the consumer groups' records", func(c classified) {
		gs := r.groups[c.Group]
		if gs == nil {
			return
		}
		gs.rep.Events += c.N
		if c.Counted {
			gs.rep.Outcomes[c.Outcome] += c.N
			return
		}
		r.judge(gs, c)
	}, r.consumerSQL(query), args...)
}

// judge decides what an event a group has no dedup record of is: pending
// (a problem, stuck, once older than Config.MaxPendingAge), lost,
// explained (dead-lettered, skipped), or unverifiable.
func (r *runner) judge(gs *groupState, u classified) {
	g := gs.rep
	if !gs.dedup {
		return // counted in Events; nothing can be said without records
	}
	at := u.CreatedAt
	f := Finding{
		Kind: Pending, Group: u.Group, EventID: u.EventID, EventType: u.EventType, Topic: u.Topic,
		AggregateType: u.AggregateType, AggregateID: u.AggregateID, AggregateVersion: u.Version,
		At: &at, AgeSeconds: max(r.outboxNow.Sub(u.CreatedAt), 0).Seconds(),
	}
	beforeHorizon := u.CreatedAt.Before(r.rep.DedupHorizon.Add(clockSkew))
	lost := func(detail string) {
		if beforeHorizon {
			g.Unverifiable++
			return
		}
		g.Lost++
		f.Kind, f.Severity, f.Detail = Lost, Problem, detail
		r.details.add(f)
	}
	pending := func(stage, detail string) {
		g.Pending++
		g.OldestPendingSeconds = max(g.OldestPendingSeconds, f.AgeSeconds)
		f.Severity, f.Stage, f.Detail = Info, stage, detail
		if f.AgeSeconds > r.cfg.MaxPendingAge.Seconds() {
			g.Stuck++
			f.Severity = Problem
			f.Detail += fmt.Sprintf(" (stuck: pending for longer than %s)", human(r.cfg.MaxPendingAge))
		}
		r.details.add(f)
	}
	// relayed is an event relayed to where it cannot be followed: before
	// the horizon, one without a version cannot be compared with the
	// group's either.
	relayed := func(detail string) {
		if u.Version == 0 && beforeHorizon {
			g.Unverifiable++
			return
		}
		pending("relayed", detail)
	}
	switch {
	case u.Dead, u.ConsumerDead:
		g.DeadLettered++ // the dead letter (the relay's, or the group's in held_events) is a finding of its own
		return
	case u.Skipped:
		g.SkippedEvents++ // the skipped range is a finding of its own
		return
	case !u.Relayed && u.RetryAttempts > 0:
		pending("retrying", fmt.Sprintf("committed; the relay failed to publish it %d time(s) and will retry: %s", u.RetryAttempts, held.Truncate(u.RetryError, maxReasonLength)))
		return
	case !u.Relayed:
		pending("outbox", "committed, not relayed yet")
		return
	case u.Version > 0 && u.GroupVersion != nil && *u.GroupVersion >= u.Version:
		lost(fmt.Sprintf("relayed, but the group's version of %s/%s is %d, it has no dedup record of this event, and no skipped range covers v%d",
			u.AggregateType, u.AggregateID, *u.GroupVersion, u.Version))
		return
	case r.kafka == nil:
		relayed("relayed; Kafka was not read, so whether the group has consumed it is unknown")
		return
	}
	l := r.kafka.lookup(u.EventID, u.Topic, u.CreatedAt)
	switch {
	case l.absent:
		lost(fmt.Sprintf("relayed, but not on Kafka topic %s (read from the log start, where nothing was deleted, to the high watermark)", u.Topic))
		return
	case l.deleted:
		lost(fmt.Sprintf("relayed, then deleted from Kafka topic %s by retention before the group recorded it", u.Topic))
		return
	case len(l.copies) == 0:
		relayed(fmt.Sprintf("relayed; not found on Kafka topic %s, which is compacted or missing, so where it is is unknown", u.Topic))
		return
	}
	if rec, committed, ok := r.kafka.consumedBy(u.Group, l); ok {
		lost(fmt.Sprintf("on Kafka at %s/%d offset %d; the group's committed offset there is %d, past it, but it has no dedup record of this event (nor a dead letter)",
			u.Topic, rec.partition, rec.offset, committed))
		return
	}
	rec := l.copies[0]
	pending("kafka", fmt.Sprintf("on Kafka at %s/%d offset %d, not consumed by the group yet", u.Topic, rec.partition, rec.offset))
}
