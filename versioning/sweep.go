package versioning

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
)

// Pool is what the sweeper and ReleaseGap need: queries and transactions.
// *pgxpool.Pool satisfies it.
type Pool interface {
	DBTX
	Beginner
}

// SweeperConfig configures a Sweeper.
type SweeperConfig struct {
	// Group is the consumer group whose parked events are swept. Required.
	Group string
	// ParkTimeout is how long an aggregate's oldest parked event waits for
	// the missing versions before the sweeper gives up on them: it records
	// the gap in skipped_versions, moves the version to just below the
	// lowest parked event, and applies what is parked in order. Defaults
	// to DefaultParkTimeout (15 minutes).
	ParkTimeout time.Duration
	// Interval is the pause between two passes of Run. Defaults to
	// DefaultSweepInterval (5s).
	Interval time.Duration
	// Batch is the most aggregates one pass visits, oldest parked first.
	// Defaults to DefaultSweepBatch (500).
	Batch int
	// Apply applies a parked event (see ApplyFunc). Required.
	Apply ApplyFunc
	// OnSweep, when set, is called after every pass of Run with its
	// result and error (metrics hook).
	OnSweep func(SweepResult, error)
	// Logger receives a line per skipped gap and failed release. Defaults
	// to slog.Default().
	Logger *slog.Logger
}

func (c SweeperConfig) withDefaults() SweeperConfig {
	if c.ParkTimeout == 0 {
		c.ParkTimeout = DefaultParkTimeout
	}
	if c.Interval == 0 {
		c.Interval = DefaultSweepInterval
	}
	if c.Batch == 0 {
		c.Batch = DefaultSweepBatch
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c SweeperConfig) validate() error {
	switch {
	case c.Group == "":
		return errors.New("versioning.SweeperConfig.Group is empty: name the consumer group whose parked events to sweep")
	case c.ParkTimeout < 0:
		return fmt.Errorf("versioning.SweeperConfig.ParkTimeout is %s; it must be positive", c.ParkTimeout)
	case c.Interval < 0:
		return fmt.Errorf("versioning.SweeperConfig.Interval is %s; it must be positive", c.Interval)
	case c.Batch < 0:
		return fmt.Errorf("versioning.SweeperConfig.Batch is %d; it must be positive", c.Batch)
	case c.Apply == nil:
		return errors.New("versioning.SweeperConfig.Apply is nil: the sweeper needs a function that applies a parked event")
	}
	return nil
}

// SweepResult reports one sweeper pass.
type SweepResult struct {
	// Aggregates is the number of aggregates with parked events visited.
	Aggregates int
	// Busy counts aggregates skipped because another transaction (a live
	// consumer or another sweeper) held their lock; the next pass retries.
	Busy int
	// Released counts parked events applied.
	Released int
	// Stale counts parked events discarded because a newer version had
	// been applied.
	Stale int
	// GapsSkipped and VersionsSkipped count the gaps given up on after the
	// park timeout and the versions in them.
	GapsSkipped     int
	VersionsSkipped int64 // see GapsSkipped
	// Failed counts parked events whose handler failed; they stay parked.
	Failed int
	// Parked is the number of the group's events still parked after the
	// pass.
	Parked int64
}

func (r *SweepResult) add(o SweepResult) {
	r.Aggregates += o.Aggregates
	r.Busy += o.Busy
	r.Released += o.Released
	r.Stale += o.Stale
	r.GapsSkipped += o.GapsSkipped
	r.VersionsSkipped += o.VersionsSkipped
	r.Failed += o.Failed
}

// Sweeper releases parked events: those whose missing versions arrived but
// were not drained (after ReleaseGap, or after a failed release), and,
// after the park timeout, those still waiting, by skipping the gap. Each
// aggregate is handled in its own transaction holding the aggregate's row
// lock, so the sweeper and live consumers never apply events of one
// aggregate at the same time. Several sweepers of one group may run (one per
// consumer process): an aggregate locked by one is skipped by the others.
type Sweeper struct {
	db    Pool
	store *Store
	cfg   SweeperConfig
}

// NewSweeper returns a sweeper for cfg.Group's parked events in the store's
// schema, working through db.
func (s *Store) NewSweeper(db Pool, cfg SweeperConfig) (*Sweeper, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if db == nil {
		return nil, errors.New("versioning.NewSweeper: db is nil")
	}
	return &Sweeper{db: db, store: s, cfg: cfg}, nil
}

// Sweep makes one pass over the group's aggregates with parked events,
// oldest first, at most cfg.Batch of them. A handler failure is recorded on
// the parked row and counted, not returned; the error reports database
// failures and ctx's end.
func (w *Sweeper) Sweep(ctx context.Context) (SweepResult, error) {
	var res SweepResult
	rows, err := w.db.Query(ctx, w.store.q.candidates, w.cfg.Group, w.cfg.Batch)
	if err != nil {
		return res, fmt.Errorf("versioning: find parked aggregates: %w", err)
	}
	keys, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Key, error) {
		k := Key{Group: w.cfg.Group}
		return k, r.Scan(&k.AggregateType, &k.AggregateID)
	})
	if err != nil {
		return res, fmt.Errorf("versioning: find parked aggregates: %w", err)
	}
	for _, k := range keys {
		r, err := w.sweepAggregate(ctx, k)
		res.add(r)
		if err != nil {
			return res, err
		}
	}
	res.Parked, err = w.store.CountParked(ctx, w.db, w.cfg.Group)
	return res, err
}

// sweepAggregate releases what it can of one aggregate's parked events in
// one transaction.
func (w *Sweeper) sweepAggregate(ctx context.Context, k Key) (SweepResult, error) {
	res := SweepResult{Aggregates: 1}
	err := pgx.BeginFunc(ctx, w.db, func(tx pgx.Tx) error {
		res = SweepResult{Aggregates: 1}
		current, _, ok, err := w.store.lock(ctx, tx, k, true)
		if err != nil {
			return err
		}
		if !ok {
			res.Busy++
			return nil
		}
		parked, err := w.store.parkedOf(ctx, tx, k, w.cfg.ParkTimeout, drainLimit)
		if err != nil {
			return err
		}
		for len(parked) > 0 {
			d, rest, err := w.store.drainList(ctx, tx, k, current, parked, w.cfg.Apply)
			if err != nil {
				return err
			}
			res.Released += len(d.Released)
			res.Stale += d.Stale
			current = d.Version
			if d.Failed != nil {
				res.Failed++
				w.cfg.Logger.WarnContext(ctx, "eventline: parked event failed to apply; it stays parked and is retried on the next sweep",
					"group", k.Group, "aggregate_type", k.AggregateType, "aggregate_id", k.AggregateID,
					"version", d.Failed.Version, "event_id", d.Failed.EventID, "attempts", d.Failed.ReleaseAttempts, "error", d.FailErr)
				return nil
			}
			if len(rest) == 0 || !anyExpired(rest) {
				return nil
			}
			from, to := current+1, rest[0].Version-1
			reason := fmt.Sprintf("park timeout: event %s (v%d) waited over %s for the missing versions", rest[0].EventID, rest[0].Version, w.cfg.ParkTimeout)
			if err := w.store.RecordSkipped(ctx, tx, k, from, to, reason); err != nil {
				return err
			}
			if err := w.store.setVersion(ctx, tx, k, to, 0); err != nil {
				return err
			}
			w.cfg.Logger.WarnContext(ctx, "eventline: skipped missing aggregate versions after the park timeout",
				"group", k.Group, "aggregate_type", k.AggregateType, "aggregate_id", k.AggregateID, "from", from, "to", to)
			res.GapsSkipped++
			res.VersionsSkipped += to - from + 1
			current = to
			parked = rest
		}
		return nil
	})
	if err != nil {
		return SweepResult{}, fmt.Errorf("versioning: sweep %s: %w", k, err)
	}
	return res, nil
}

func anyExpired(ps []Parked) bool {
	for _, p := range ps {
		if p.expired {
			return true
		}
	}
	return false
}

// Run sweeps every cfg.Interval until ctx ends, then returns nil. A failed
// pass is logged (and reported to OnSweep) and retried on the next tick.
func (w *Sweeper) Run(ctx context.Context) error {
	t := time.NewTicker(w.cfg.Interval)
	defer t.Stop()
	for {
		res, err := w.Sweep(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			w.cfg.Logger.ErrorContext(ctx, "eventline: sweep of parked events failed; retrying on the next tick", "group", w.cfg.Group, "error", err)
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
