package store

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/txhooks"
)

var (
	// The sweeper's candidates: aggregates whose lowest parked event
	// is due (no release backoff pending) and either ready (its
	// predecessor applied, or its version passed) or behind a gap
	// older than the park timeout ($3, microseconds). Ordered by when
	// they became due, so aggregates whose events keep failing (each
	// failure pushes its next attempt back) cannot starve the others.
	candidatesSQL = statement(`SELECT p.aggregate_type, p.aggregate_id FROM (
			SELECT aggregate_type, aggregate_id, min(parked_at) AS oldest,
				(array_agg(previous_version ORDER BY aggregate_version))[1] AS head_previous,
				(array_agg(next_attempt_at ORDER BY aggregate_version))[1] AS head_next
			FROM {schema}.parked_events WHERE consumer_group = $1 GROUP BY aggregate_type, aggregate_id
		) p JOIN {schema}.aggregate_versions av ON av.consumer_group = $1 AND av.aggregate_type = p.aggregate_type AND av.aggregate_id = p.aggregate_id
		WHERE (p.head_next IS NULL OR p.head_next <= now())
			AND (p.head_previous <= av.version OR p.oldest <= now() - $3::bigint * interval '1 microsecond')
		ORDER BY coalesce(p.head_next, p.oldest) LIMIT $2`)
)

// SweeperConfig configures a Sweeper. Every field is required but OnSweep:
// the middleware fills them from its Config.
type SweeperConfig struct {
	// Group is the consumer group whose parked events are swept.
	Group string
	// ParkTimeout is how long an aggregate's oldest parked event waits for
	// the missing versions before the sweeper gives up on them: it records
	// the gap in skipped_versions, moves the version to the lowest parked
	// event's predecessor, and applies what is parked in order.
	ParkTimeout time.Duration
	// Interval is the pause between two passes of Run.
	Interval time.Duration
	// TxTimeout bounds each aggregate's transaction in a pass, so a
	// connection that stops answering fails the pass instead of hanging
	// it.
	TxTimeout time.Duration
	// Batch is the most aggregates one pass visits, those due longest
	// first.
	Batch int
	// Release says how parked and late events are applied.
	Release ReleaseOptions
	// OnSweep, when set, is called after every pass of Run with its
	// result and error (metrics hook).
	OnSweep func(SweepResult, error)
	// Logger receives a line per skipped gap and failed release.
	Logger *slog.Logger
}

// SweepResult reports one sweeper pass.
type SweepResult struct {
	// Aggregates is the number of aggregates visited.
	Aggregates int
	// Busy counts aggregates skipped because another transaction (a live
	// consumer or another sweeper) held their lock; the next pass retries.
	Busy int
	// Released counts parked events applied.
	Released int
	// Late counts parked events held as late because their
	// aggregate had passed their version.
	Late int
	// GapsSkipped counts the gaps given up on after the park timeout;
	// VersionsSkipped the versions recorded as skipped, theirs and those
	// of the parked events given up.
	GapsSkipped     int
	VersionsSkipped int64 // see GapsSkipped
	// Failed counts failed attempts to apply parked events; they stay
	// parked and are retried after a backoff.
	Failed int
	// DeadLettered counts parked events given up (see HoldFailed).
	DeadLettered int
	// LateApplied and LateFailed count operator-requested applies of late
	// events that succeeded and failed.
	LateApplied int
	LateFailed  int // see LateApplied
	// Parked and HeldLate are the numbers of the group's events still
	// parked and held as late after the pass.
	Parked   int64
	HeldLate int64 // see Parked
	// GapsClosed are the gaps the pass skipped after the park timeout,
	// and those an operator released whose parked events it applied.
	GapsClosed []ClosedGap
}

func (r *SweepResult) add(o SweepResult) {
	r.Aggregates += o.Aggregates
	r.Busy += o.Busy
	r.Released += o.Released
	r.Late += o.Late
	r.GapsSkipped += o.GapsSkipped
	r.VersionsSkipped += o.VersionsSkipped
	r.Failed += o.Failed
	r.DeadLettered += o.DeadLettered
	r.LateApplied += o.LateApplied
	r.LateFailed += o.LateFailed
	r.GapsClosed = append(r.GapsClosed, o.GapsClosed...)
}

// Sweeper releases parked events: those whose missing versions arrived but
// were not drained (after ReleaseGap, or after a failed release), and,
// after the park timeout, those still waiting, by skipping the gap. It
// gives up (dead-letters) parked events that keep failing, and applies the
// late events an operator asked for. Each aggregate is handled in its own
// transaction holding the aggregate's row lock, so the sweeper and live
// consumers never apply events of one aggregate at the same time. Several
// sweepers of one group may run (one per consumer process): an aggregate
// locked by one is skipped by the others.
type Sweeper struct {
	db    Pool
	store *Store
	cfg   SweeperConfig
	// healthySince is when Run started or its last failed pass ended
	// (UnixNano; 0 when Run never ran): see parkTimeout.
	healthySince atomic.Int64
}

// NewSweeper returns a sweeper for cfg.Group's parked events in the store's
// schema, working through db.
func (s *Store) NewSweeper(db Pool, cfg SweeperConfig) *Sweeper {
	return &Sweeper{db: db, store: s, cfg: cfg}
}

// Sweep makes one pass: over the group's aggregates whose lowest parked
// event is due (ready, or behind a gap older than the park timeout, and not
// waiting for a release backoff), those due longest first, at most
// cfg.Batch of them; then over the late events an operator asked to apply.
// A handler failure is recorded on the event and counted, not returned;
// the error reports database failures and ctx's end.
//
// AfterCommit hooks (internal/txhooks) registered while applying an event
// run after that aggregate's transaction commits; one that panics is
// recovered and reported (txhooks.WithPanicHandler), and the others, and
// the pass, go on.
func (w *Sweeper) Sweep(ctx context.Context) (SweepResult, error) {
	var res SweepResult
	timeout := w.parkTimeout()
	var keys []Key
	rows, err := w.db.Query(ctx, w.store.q(candidatesSQL), w.cfg.Group, w.cfg.Batch, timeout.Microseconds())
	if err == nil {
		keys, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (Key, error) {
			k := Key{Group: w.cfg.Group}
			return k, r.Scan(&k.AggregateType, &k.AggregateID)
		})
	}
	if err != nil {
		return res, fmt.Errorf("eventline: find parked aggregates: %w", err)
	}
	for _, k := range keys {
		r, err := w.sweepAggregate(ctx, k, func(ctx context.Context, tx pgx.Tx, k Key, current int64, res *SweepResult) error {
			return w.parked(ctx, tx, k, current, timeout, res)
		})
		res.add(r)
		if err != nil {
			return res, err
		}
	}
	aggs, err := w.store.held.LateAggregates(ctx, w.db, w.cfg.Group, w.cfg.Batch)
	if err != nil {
		return res, fmt.Errorf("eventline: %w", err)
	}
	for _, a := range aggs {
		k := Key{Group: w.cfg.Group, AggregateType: a.Type, AggregateID: a.ID}
		r, err := w.sweepAggregate(ctx, k, func(ctx context.Context, tx pgx.Tx, k Key, _ int64, res *SweepResult) error {
			return w.store.applyLate(ctx, tx, k, w.cfg.Release, res)
		})
		res.add(r)
		if err != nil {
			return res, err
		}
	}
	if res.Parked, err = w.store.CountParked(ctx, w.db, w.cfg.Group); err != nil {
		return res, err
	}
	res.HeldLate, err = w.store.held.CountOpen(ctx, w.db, w.cfg.Group, held.KindLate)
	return res, err
}

// neverExpires stands for "no park timeout this pass": a century, far
// beyond any parked_at, yet a valid PostgreSQL interval.
const neverExpires = 100 * 365 * 24 * time.Hour

// parkTimeout is the park timeout of this pass: cfg.ParkTimeout, unless
// Run has not been healthy that long yet (it just started, or the database
// was unreachable; see Run): then no gap expires this pass.
func (w *Sweeper) parkTimeout() time.Duration {
	since := w.healthySince.Load()
	if since != 0 && time.Since(time.Unix(0, since)) < w.cfg.ParkTimeout {
		return neverExpires
	}
	return w.cfg.ParkTimeout
}

// sweepAggregate runs work for one aggregate in a transaction holding its
// lock (skipping it when another transaction holds it), then the hooks
// registered while applying events, once it committed.
func (w *Sweeper) sweepAggregate(ctx context.Context, k Key, work func(context.Context, pgx.Tx, Key, int64, *SweepResult) error) (SweepResult, error) {
	var res SweepResult
	ctx, cancel := context.WithTimeout(ctx, w.cfg.TxTimeout)
	defer cancel()
	hctx, hooks := txhooks.New(ctx)
	err := pgx.BeginFunc(hctx, w.db, func(tx pgx.Tx) error {
		hooks.Drop()
		res = SweepResult{Aggregates: 1}
		current, _, ok, err := w.store.lock(hctx, tx, k, true)
		if err != nil {
			return err
		}
		if !ok {
			res.Busy++
			return nil
		}
		return work(hctx, tx, k, current, &res)
	})
	if err != nil {
		hooks.Drop()
		return SweepResult{}, fmt.Errorf("eventline: sweep %s: %w", k, err)
	}
	hooks.Run()
	return res, nil
}

// parked releases what it can of one aggregate's parked events.
func (w *Sweeper) parked(ctx context.Context, tx pgx.Tx, k Key, current int64, timeout time.Duration, res *SweepResult) error {
	d, err := w.store.drain(ctx, tx, k, current, w.cfg.Release, timeout)
	if err != nil {
		return err
	}
	res.Released += len(d.Released)
	res.Late += d.Late
	res.GapsSkipped += d.GapsSkipped
	res.VersionsSkipped += d.VersionsSkipped
	res.DeadLettered += len(d.DeadLettered)
	res.GapsClosed = append(res.GapsClosed, d.GapsClosed...)
	log := w.cfg.Logger
	if d.GapsSkipped > 0 {
		log.WarnContext(ctx, "eventline: skipped missing aggregate versions after the park timeout",
			"group", k.Group, "aggregate_type", k.AggregateType, "aggregate_id", k.AggregateID,
			"gaps", d.GapsSkipped, "versions", d.VersionsSkipped, "now_at", d.Version)
	}
	for _, p := range d.DeadLettered {
		log.ErrorContext(ctx, "eventline: gave up on a parked event that cannot be applied; dead-lettered, its version recorded as skipped",
			"group", k.Group, "aggregate_type", k.AggregateType, "aggregate_id", k.AggregateID,
			"version", p.Version, "event_id", p.EventID, "attempts", p.ReleaseAttempts, "error", p.LastError)
	}
	if d.Failed != nil {
		res.Failed++
		log.WarnContext(ctx, "eventline: parked event failed to apply; it stays parked and is retried after a backoff",
			"group", k.Group, "aggregate_type", k.AggregateType, "aggregate_id", k.AggregateID,
			"version", d.Failed.Version, "event_id", d.Failed.EventID, "attempts", d.Failed.ReleaseAttempts,
			"max_attempts", w.cfg.Release.MaxAttempts, "error", d.FailErr)
	}
	return nil
}

// Run sweeps every cfg.Interval until ctx ends, then returns nil. A failed
// pass (the database unreachable or not answering) is reported to OnSweep
// and retried on the next tick; it is logged once when passes start
// failing and once when they succeed again.
//
// The park timeout counts from when Run started or its last failed pass
// ended, whichever is later, as well as from when the event parked: a
// consumer that was down, or cut off from its database, first gets a full
// park timeout to catch up with the backlog on Kafka before it gives up on
// any gap.
func (w *Sweeper) Run(ctx context.Context) error {
	t := time.NewTicker(w.cfg.Interval)
	defer t.Stop()
	w.healthySince.Store(time.Now().UnixNano())
	var failing time.Time
	for {
		res, err := w.Sweep(ctx)
		if ctx.Err() != nil {
			return nil
		}
		switch {
		case err != nil && failing.IsZero():
			failing = time.Now()
			w.cfg.Logger.ErrorContext(ctx, "eventline: sweeps of parked events are failing; retrying every interval, and no gap expires until they succeed for a whole park timeout",
				"group", w.cfg.Group, "interval", w.cfg.Interval, "error", err)
		case err != nil:
			w.cfg.Logger.DebugContext(ctx, "eventline: sweep of parked events failed again", "group", w.cfg.Group, "error", err)
		case !failing.IsZero():
			w.cfg.Logger.InfoContext(ctx, "eventline: sweeps of parked events succeed again", "group", w.cfg.Group,
				"failed_for", time.Since(failing).Round(time.Millisecond))
			failing = time.Time{}
		}
		if err != nil {
			w.healthySince.Store(time.Now().UnixNano())
		}
		if w.cfg.OnSweep != nil {
			w.cfg.OnSweep(res, err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
