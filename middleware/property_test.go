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
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
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
// delayed and reordered events over several aggregates, through the
// composed middleware on PostgreSQL, with one to three workers in flight
// at a time, each delivering one event at a time or batches of up to six
// (one batch, internal/delivery: one transaction; failures, panics, duplicates and
// reordered versions of one aggregate inside a batch). Versions are sparse: each event declares the version it
// follows (aggregate_previous_version), some aggregates skip more than
// MaxGap versions at a step (never refused: the gate waits for the
// predecessor an event declares), and some are never delivered. The
// handler fails or panics a few times for some events, the sweeper runs at
// random points (sometimes giving up every gap at once, so delayed events
// arrive late), parked events may exhaust a small release-attempt limit,
// and late events are held or applied at once, by event type. After a
// final sweep and an operator applying every held late event, it checks:
//
//   - every event was applied in order at most once, and its AfterCommit
//     hook ran exactly once per committed application, drains and sweeper
//     included;
//   - each aggregate's in-order versions strictly increase, and its final
//     state equals their in-order application;
//   - every version the producer used up to the aggregate's final one was
//     applied in order or is audited, exactly once, in skipped_versions,
//     and no applied version is audited as skipped;
//   - every delivered event was applied in order, or is late (its version
//     audited as skipped) and was then applied once, marked late (IsLate);
//     nothing was silently discarded, nothing stays parked or held.
func TestPropertyOnceAndInOrder(t *testing.T) {
	t.Parallel()
	env := consumertest.New(t, pgtest.Options{MaxConns: 6})
	var run atomic.Int64
	rapid.Check(t, func(rt *rapid.T) {
		group := fmt.Sprintf("prop-%d", run.Add(1))
		checkOnceAndInOrder(rt, env, group)
	})
}

// counts is a per-event-id counter shared by concurrent handlers.
type counts struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *counts) inc(id string) {
	c.mu.Lock()
	c.n[id]++
	c.mu.Unlock()
}

func (c *counts) get(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[id]
}

func checkOnceAndInOrder(rt *rapid.T, env consumertest.Env, group string) {
	ctx := context.Background()

	// Policies: all Park, all Apply, or mixed by event type; late events
	// held, applied at once, or mixed.
	mode := rapid.SampledFrom([]string{"park", "apply", "mixed"}).Draw(rt, "policy")
	cfg := middleware.Config{Schema: env.Schema, Group: group, ParkTimeout: time.Hour,
		ReleaseBackoff: eventline.Backoff{Initial: time.Nanosecond}, MaxReleaseAttempts: rapid.IntRange(1, 3).Draw(rt, "maxReleaseAttempts"), Logger: quiet()}
	switch mode {
	case "apply":
		cfg.GapPolicy = versioning.Apply
	case "mixed":
		cfg.PolicyByType = map[string]versioning.GapPolicy{"thing.jumped": versioning.Apply}
	}
	switch rapid.SampledFrom([]string{"hold", "apply", "mixed"}).Draw(rt, "latePolicy") {
	case "apply":
		cfg.LatePolicy = versioning.ApplyLate
	case "mixed":
		cfg.LatePolicyByType = map[string]versioning.LatePolicy{"thing.changed": versioning.ApplyLate}
	}
	if rapid.Bool().Draw(rt, "eagerSweeper") {
		cfg.ParkTimeout = time.Nanosecond // every sweep skips every gap
	}

	// Failure budget per event id: the first calls fail (error or panic).
	var failMu sync.Mutex
	failures := map[string]int{}
	panics := map[string]bool{}
	hooks := &counts{n: map[string]int{}}
	late := &counts{n: map[string]int{}}
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
		isLate := middleware.IsLate(ctx)
		if !isLate {
			// Late events do not touch the order-sensitive state.
			if err := env.Apply(ctx, tx, group, e); err != nil {
				return nil, err
			}
		}
		middleware.AfterCommit(ctx, func() {
			if isLate {
				late.inc(e.ID)
			} else {
				hooks.inc(e.ID)
			}
		})
		if fail {
			if boom {
				panic("injected panic")
			}
			return nil, errors.New("injected failure")
		}
		return nil, nil
	}
	el, err := middleware.New(env.Pool, cfg)
	require.NoError(rt, err)
	h := el.MiddlewareFor("test")(handler)
	final := cfg
	final.ParkTimeout = time.Nanosecond
	finalEl, err := middleware.New(env.Pool, final)
	require.NoError(rt, err)
	finalEl.MiddlewareFor("test")(handler) // registers the handler for the final sweep

	// Aggregates, sparse versions, which are delivered and how often.
	nAgg := rapid.IntRange(1, 4).Draw(rt, "aggregates")
	chain := map[string][]int64{} // every version the producer used
	delivered := map[string][]eventline.Event{}
	var ops []op
	for a := 0; a < nAgg; a++ {
		id := fmt.Sprintf("agg-%d", a)
		n := rapid.IntRange(1, 7).Draw(rt, "versions")
		// A sparse aggregate's producer skips versions at every step, some
		// by far more than MaxGap (1000), so each event declares its
		// predecessor: the gate waits for it however far back it is. An
		// event that follows v-1 says nothing about the versions below
		// and is bounded by MaxGap, so sparse aggregates have none.
		sparse := rapid.Bool().Draw(rt, "sparse")
		prev := int64(0)
		for i := 0; i < n; i++ {
			v := prev + 1
			switch {
			case prev > 0 && sparse && rapid.Bool().Draw(rt, "farStep"):
				v = prev + int64(rapid.IntRange(1001, 3000).Draw(rt, "step"))
			case prev > 0 && sparse:
				v = prev + int64(rapid.IntRange(2, 3).Draw(rt, "step"))
			case prev > 0:
				v = prev + int64(rapid.IntRange(1, 3).Draw(rt, "step"))
			}
			chain[id] = append(chain[id], v)
			e := consumertest.Event(id, v)
			e.PreviousVersion, prev = prev, v
			if rapid.IntRange(0, 99).Draw(rt, "delivered") >= 85 {
				continue // never delivered: a gap the sweeper must skip
			}
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
				failures[e.ID] = rapid.IntRange(1, 3).Draw(rt, "failures")
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
	// Each worker takes up to batch consecutive deliveries at once and
	// hands them over as one batch (1: one at a time).
	batch := rapid.IntRange(1, 6).Draw(rt, "batch")

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
				if queue[0].sweep {
					queue = queue[1:]
					qmu.Unlock()
					if err := el.Sweep(ctx); err != nil {
						errs <- err
						return
					}
					continue
				}
				n := 1
				for n < batch && n < len(queue) && !queue[n].sweep {
					n++
				}
				taken := slices.Clone(queue[:n])
				queue = queue[n:]
				qmu.Unlock()
				failed, err := deliver(ctx, h, taken)
				if err != nil {
					errs <- err
					return
				}
				qmu.Lock()
				for _, o := range failed {
					at := min(o.requeue, len(queue))
					queue = slices.Insert(queue, at, o)
				}
				qmu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(rt, err)
	}
	// Final sweeps give up on every remaining gap; parked events that keep
	// failing are given up after the attempt limit.
	for i := 0; i < 50; i++ {
		res, err := finalEl.SweepResult(ctx)
		require.NoError(rt, err)
		if res.Parked == 0 {
			break
		}
	}
	st := finalEl.Store()
	held := checkHeld(rt, env, st, group, delivered, late)

	// The operator replays every held late event (again, while a handler
	// keeps failing and it is held again after the attempt limit).
	for i := 0; i < 50; i++ {
		list, err := admin.ListHeld(ctx, env.Pool, env.Schema, admin.HeldFilter{Kind: admin.HeldLate, Group: group, Limit: 1000})
		require.NoError(rt, err)
		if len(list) == 0 {
			break
		}
		_, err = admin.ReplayHeld(ctx, env.Pool, env.Schema, admin.HeldFilter{Kind: admin.HeldLate, Group: group})
		if !errors.Is(err, admin.ErrNoHeld) { // all of them may wait for a retry
			require.NoError(rt, err)
		}
		_, err = finalEl.SweepResult(ctx)
		require.NoError(rt, err)
	}
	for id := range held {
		require.Equal(rt, 1, late.get(id), "held late event %s applied once on the operator's request", id)
	}
	checkInvariants(rt, env, st, group, chain, delivered, hooks, late)
}

// deliver runs ops through h, alone when there is one, else concurrently
// as the members of one batch, the way the consumer's
// Subscriber delivers a lane's events. It returns the ops whose delivery
// failed (to be redelivered).
func deliver(ctx context.Context, h message.HandlerFunc, ops []op) (failed []op, err error) {
	if len(ops) == 1 {
		if _, err := h(consumertest.Redeliver(ops[0].msg)); err != nil {
			if middleware.IsPermanent(err) {
				return nil, fmt.Errorf("unexpected permanent error: %w", err)
			}
			return ops, nil
		}
		return nil, nil
	}
	msgs := make([]*message.Message, len(ops))
	for i, o := range ops {
		msgs[i] = o.msg
	}
	for i, err := range deliverBatchTo(ctx, delivery.NewBatch(), h, msgs...) {
		if err == nil {
			continue
		}
		if middleware.IsPermanent(err) {
			return nil, fmt.Errorf("unexpected permanent error: %w", err)
		}
		failed = append(failed, ops[i])
	}
	return failed, nil
}

// checkHeld checks the events held as late after the final sweep: each is
// a delivered event whose version was skipped, with outcome late, not yet
// applied. It returns their ids.
func checkHeld(rt *rapid.T, env consumertest.Env, st *store.Store, group string, delivered map[string][]eventline.Event, late *counts) map[string]bool {
	ctx := context.Background()
	list, err := admin.ListHeld(ctx, env.Pool, env.Schema, admin.HeldFilter{Kind: admin.HeldLate, Group: group, Limit: 1000})
	require.NoError(rt, err)
	byID := map[string]eventline.Event{}
	for _, evs := range delivered {
		for _, e := range evs {
			byID[e.ID] = e
		}
	}
	held := map[string]bool{}
	for _, l := range list {
		e, ok := byID[l.EventID]
		require.True(rt, ok, "late event %s was delivered", l.EventID)
		require.Equal(rt, e.AggregateVersion, l.AggregateVersion)
		require.Zero(rt, late.get(l.EventID), "a held late event has not been applied")
		r, err := st.Processed(ctx, env.Pool, store.RecordKey{Group: l.Group, EventID: l.EventID, AggregateType: l.AggregateType, AggregateID: l.AggregateID})
		require.NoError(rt, err)
		require.Equal(rt, dedup.OutcomeLate, r.Outcome)
		held[l.EventID] = true
	}
	return held
}

func checkInvariants(rt *rapid.T, env consumertest.Env, st *store.Store, group string, chain map[string][]int64,
	delivered map[string][]eventline.Event, hooks, late *counts) {
	ctx := context.Background()
	effects := env.Effects(rt, group)
	times := map[string]int{}
	applied := map[string][]int64{}
	for _, e := range effects {
		times[e.EventID]++
		require.Equal(rt, 1, times[e.EventID], "event %s (%s v%d) applied twice", e.EventID, e.AggregateID, e.Version)
		require.Equal(rt, 1, hooks.get(e.EventID), "event %s (%s v%d): its AfterCommit hook runs once per committed application", e.EventID, e.AggregateID, e.Version)
		vs := applied[e.AggregateID]
		if len(vs) > 0 {
			require.Greater(rt, e.Version, vs[len(vs)-1], "aggregate %s applied out of order: %v then %d", e.AggregateID, vs, e.Version)
		}
		applied[e.AggregateID] = append(vs, e.Version)
	}
	parked, err := st.ListParked(ctx, env.Pool, store.ParkedFilter{Group: group})
	require.NoError(rt, err)
	require.Empty(rt, parked, "nothing stays parked after the final sweep")
	held, err := admin.ListHeld(ctx, env.Pool, env.Schema, admin.HeldFilter{Kind: admin.HeldLate, Group: group})
	require.NoError(rt, err)
	require.Empty(rt, held, "the operator applied every late event")

	for id, evs := range delivered {
		k := store.Key{Group: group, AggregateType: "thing", AggregateID: id}
		current, err := st.Current(ctx, env.Pool, k)
		require.NoError(rt, err)
		maxDelivered := evs[len(evs)-1].AggregateVersion
		require.Equal(rt, maxDelivered, current, "aggregate %s ends at its highest delivered version", id)

		// Final state = in-order application of the in-order versions.
		value, last := env.State(rt, group, "thing", id)
		want := int64(0)
		for _, v := range applied[id] {
			want = consumertest.Fold(want, v)
		}
		require.Equal(rt, want, value, "aggregate %s state", id)
		if n := len(applied[id]); n > 0 {
			require.Equal(rt, applied[id][n-1], last)
		}

		// Versions the producer used, up to current: each applied in order
		// or skipped, exactly once; no applied version is skipped.
		skipped, err := st.ListSkipped(ctx, env.Pool, store.SkippedFilter{Group: group, AggregateID: id, Limit: 1000})
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
		for _, v := range chain[id] {
			if v <= current {
				require.NotEmpty(rt, covered[v], "aggregate %s v%d neither applied nor audited as skipped", id, v)
			}
		}

		// Every delivered event: applied in order once, or late (its
		// version skipped) and applied late once.
		for _, e := range evs {
			r, err := st.Processed(ctx, env.Pool, store.RecordKeyOf(group, e))
			require.NoError(rt, err)
			if times[e.ID] == 1 {
				require.Equal(rt, dedup.OutcomeApplied, r.Outcome)
				require.Zero(rt, late.get(e.ID))
				continue
			}
			require.Equal(rt, "skipped", covered[e.AggregateVersion], "event %s v%d was not applied in order, so its version must be audited as skipped", id, e.AggregateVersion)
			require.Equal(rt, dedup.OutcomeLateApplied, r.Outcome, "event %s v%d is late: never silently dropped", id, e.AggregateVersion)
			require.Equal(rt, 1, late.get(e.ID), "late event %s v%d applied once, marked late", id, e.AggregateVersion)
		}
	}
}

// TestPropertyBatchAdmitsSharedIDsInArrivalOrder draws batches of events
// over a few aggregates and ids. The admissions are queued in lock order
// (sorted by aggregate) and, for any two members that write the same
// processed_events row (same event id in the same aggregate), the one that
// arrived first is admitted first, so it is the one recorded, as one at a
// time. (Members of different aggregates sharing an id write different
// rows: the order between them decides nothing.)
func TestPropertyBatchAdmitsSharedIDsInArrivalOrder(t *testing.T) {
	t.Parallel()
	rapid.Check(t, func(rt *rapid.T) {
		events := rapid.SliceOfN(rapid.Custom(func(rt *rapid.T) eventline.Event {
			return eventline.Event{
				ID:            rapid.SampledFrom([]string{"e1", "e2", "e3"}).Draw(rt, "id"),
				AggregateType: rapid.SampledFrom([]string{"t", "u"}).Draw(rt, "type"),
				AggregateID:   rapid.SampledFrom([]string{"a", "b", "c"}).Draw(rt, "aggregate"),
			}
		}), 1, 10).Draw(rt, "batch")
		aggregate := func(e eventline.Event) string { return e.AggregateType + "\x00" + e.AggregateID }
		record := func(e eventline.Event) string { return aggregate(e) + "\x00" + e.ID } // the processed_events row it writes
		order := middleware.AdmissionOrder(events)
		require.ElementsMatch(rt, order, indexes(len(events)))
		pos := make([]int, len(events))
		for p, i := range order {
			pos[i] = p
			if p > 0 {
				require.LessOrEqual(rt, aggregate(events[order[p-1]]), aggregate(events[i]), "lock order")
			}
		}
		for i := range events {
			for j := i + 1; j < len(events); j++ {
				if record(events[i]) == record(events[j]) {
					require.Less(rt, pos[i], pos[j], "members %d and %d share a record: arrival order", i, j)
				}
			}
		}
	})
}

func indexes(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}
