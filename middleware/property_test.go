package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/versioning"
)

// op is one step of a schedule: deliver a message, or run a sweeper pass.
type op struct {
	sweep bool
	ev    eventline.Event
	msg   *message.Message
	// requeue is how many ops later a failed delivery is redelivered.
	requeue int
}

// TestPropertyOnceAndInOrder feeds random interleavings of duplicated,
// delayed and reordered events over several aggregates, some versions never
// delivered, with transient handler failures and panics and sweeper passes
// at random points, through the composed middleware on PostgreSQL, with one
// to three deliveries in flight at a time. After a final sweep it checks:
//
//   - every effect was applied at most once, and every delivered event was
//     either applied or discarded because its version was skipped;
//   - each aggregate's applied versions strictly increase;
//   - each aggregate's final state equals the in-order application of its
//     applied versions;
//   - every version up to the aggregate's final one was applied or is
//     audited, exactly once, in skipped_versions; nothing stays parked.
func TestPropertyOnceAndInOrder(t *testing.T) {
	t.Parallel()
	env := consumertest.New(t, pgtest.Options{MaxConns: 6})
	var run atomic.Int64
	rapid.Check(t, func(rt *rapid.T) {
		group := fmt.Sprintf("prop-%d", run.Add(1))
		checkOnceAndInOrder(rt, env, group)
	})
}

func checkOnceAndInOrder(rt *rapid.T, env consumertest.Env, group string) {
	ctx := context.Background()

	// Policies: all Park, all Apply, or mixed by event type.
	mode := rapid.SampledFrom([]string{"park", "apply", "mixed"}).Draw(rt, "policy")
	cfg := middleware.Config{DB: env.Pool, Schema: env.Schema, Group: group, ParkTimeout: time.Hour, Logger: quiet()}
	switch mode {
	case "apply":
		cfg.GapPolicy = versioning.Apply
	case "mixed":
		cfg.PolicyByType = map[string]versioning.GapPolicy{"thing.jumped": versioning.Apply}
	}
	if rapid.Bool().Draw(rt, "eagerSweeper") {
		cfg.ParkTimeout = time.Nanosecond // every sweep skips every gap
	}

	// Failure budget per event id: the first calls fail (error or panic).
	var failMu sync.Mutex
	failures := map[string]int{}
	panics := map[string]bool{}
	handler := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, _ := middleware.TxFromContext(ctx)
		e, _ := middleware.EventFromContext(ctx)
		failMu.Lock()
		fail := failures[e.ID] > 0
		if fail {
			failures[e.ID]--
		}
		boom := panics[e.ID]
		failMu.Unlock()
		if err := env.Apply(ctx, tx, group, e); err != nil {
			return nil, err
		}
		if fail {
			if boom {
				panic("injected panic")
			}
			return nil, errors.New("injected failure")
		}
		return nil, nil
	}
	el, err := middleware.New(cfg)
	require.NoError(rt, err)
	h := el.Middleware(handler)
	final := cfg
	final.ParkTimeout = time.Nanosecond
	finalEl, err := middleware.New(final)
	require.NoError(rt, err)
	finalEl.Middleware(handler) // registers the handler for the final sweep

	// Aggregates, versions, which are delivered and how often.
	nAgg := rapid.IntRange(1, 4).Draw(rt, "aggregates")
	delivered := map[string][]eventline.Event{}
	var ops []op
	for a := 0; a < nAgg; a++ {
		id := fmt.Sprintf("agg-%d", a)
		maxV := rapid.IntRange(1, 7).Draw(rt, "versions")
		for v := int64(1); v <= int64(maxV); v++ {
			if rapid.IntRange(0, 99).Draw(rt, "delivered") >= 85 {
				continue // never delivered: a gap the sweeper must skip
			}
			e := consumertest.Event(id, v)
			if mode == "mixed" && rapid.Bool().Draw(rt, "jumpType") {
				e.Type = "thing.jumped"
			}
			delivered[id] = append(delivered[id], e)
			msg := consumertest.Message(rt, e)
			copies := rapid.IntRange(1, 3).Draw(rt, "copies")
			for c := 0; c < copies; c++ {
				ops = append(ops, op{ev: e, msg: msg})
			}
			switch rapid.IntRange(0, 9).Draw(rt, "failure") {
			case 0:
				failures[e.ID] = 1
			case 1:
				failures[e.ID], panics[e.ID] = 1, true
			}
		}
	}
	// Reorder: a random permutation, then sweeps at random points.
	perm := rapid.Permutation(ops).Draw(rt, "order")
	ops = ops[:0]
	for _, o := range perm {
		if rapid.IntRange(0, 5).Draw(rt, "sweepHere") == 0 {
			ops = append(ops, op{sweep: true})
		}
		o.requeue = rapid.IntRange(0, 5).Draw(rt, "requeue")
		ops = append(ops, o)
	}
	workers := rapid.IntRange(1, 3).Draw(rt, "workers")

	// Execute: workers take ops in order; a failed delivery goes back into
	// the queue a little later, like a redelivery.
	var qmu sync.Mutex
	queue := slices.Clone(ops)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				qmu.Lock()
				if len(queue) == 0 {
					qmu.Unlock()
					return
				}
				o := queue[0]
				queue = queue[1:]
				qmu.Unlock()
				if o.sweep {
					if _, err := el.Sweep(ctx); err != nil {
						errs <- err
						return
					}
					continue
				}
				if _, err := h(consumertest.Redeliver(o.msg)); err != nil {
					if middleware.IsPermanent(err) {
						errs <- fmt.Errorf("unexpected permanent error: %w", err)
						return
					}
					qmu.Lock()
					at := min(o.requeue, len(queue))
					queue = slices.Insert(queue, at, o)
					qmu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(rt, err)
	}
	// Final sweeps give up on every remaining gap (each parked event whose
	// handler still has a failure budget stops one pass).
	for i := 0; i < 50; i++ {
		res, err := finalEl.Sweep(ctx)
		require.NoError(rt, err)
		if res.Parked == 0 {
			break
		}
	}

	checkInvariants(rt, env, finalEl.Store(), group, delivered)
}

func checkInvariants(rt *rapid.T, env consumertest.Env, store *versioning.Store, group string, delivered map[string][]eventline.Event) {
	ctx := context.Background()
	effects := env.Effects(rt, group)
	times := map[string]int{}
	applied := map[string][]int64{}
	for _, e := range effects {
		times[e.EventID]++
		require.Equal(rt, 1, times[e.EventID], "event %s (%s v%d) applied twice", e.EventID, e.AggregateID, e.Version)
		vs := applied[e.AggregateID]
		if len(vs) > 0 {
			require.Greater(rt, e.Version, vs[len(vs)-1], "aggregate %s applied out of order: %v then %d", e.AggregateID, vs, e.Version)
		}
		applied[e.AggregateID] = append(vs, e.Version)
	}
	parked, err := store.ListParked(ctx, env.Pool, versioning.ParkedFilter{Group: group})
	require.NoError(rt, err)
	require.Empty(rt, parked, "nothing stays parked after the final sweep")

	for id, evs := range delivered {
		k := versioning.Key{Group: group, AggregateType: "thing", AggregateID: id}
		current, err := store.Current(ctx, env.Pool, k)
		require.NoError(rt, err)
		maxDelivered := evs[len(evs)-1].AggregateVersion
		require.Equal(rt, maxDelivered, current, "aggregate %s ends at its highest delivered version", id)

		// Final state = in-order application of the applied versions.
		value, last := env.State(rt, group, "thing", id)
		want := int64(0)
		for _, v := range applied[id] {
			want = consumertest.Fold(want, v)
		}
		require.Equal(rt, want, value, "aggregate %s state", id)
		require.Equal(rt, maxDelivered, last)

		// Versions 1..current: each applied or skipped, exactly once.
		skipped, err := store.ListSkipped(ctx, env.Pool, versioning.SkippedFilter{Group: group, AggregateID: id, Limit: 1000})
		require.NoError(rt, err)
		covered := map[int64]string{}
		for _, v := range applied[id] {
			covered[v] = "applied"
		}
		for _, s := range skipped {
			for v := s.From; v <= s.To; v++ {
				require.Empty(rt, covered[v], "aggregate %s v%d skipped but already %s", id, v, covered[v])
				covered[v] = "skipped"
			}
		}
		for v := int64(1); v <= current; v++ {
			require.NotEmpty(rt, covered[v], "aggregate %s v%d neither applied nor audited as skipped", id, v)
		}

		// Every delivered event: applied once, or stale because skipped.
		for _, e := range evs {
			r, err := store.Dedup().Get(ctx, env.Pool, group, e.ID)
			require.NoError(rt, err)
			if times[e.ID] == 1 {
				require.Equal(rt, dedup.OutcomeApplied, r.Outcome)
			} else {
				require.Equal(rt, dedup.OutcomeStale, r.Outcome, "event %s v%d", id, e.AggregateVersion)
				require.Equal(rt, "skipped", covered[e.AggregateVersion], "a delivered event is only dropped when its version was skipped")
			}
		}
	}
}
