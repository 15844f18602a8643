package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin/verify"
)

// What the chaos tests (relays, consumers, PostgreSQL crashes) share: a
// seeded stream of events to publish, and the checks once the faults are
// over.

// publishRandomly hands publish order.updated events over 16 aggregates,
// one to three per call, every 5 to 25 ms (seeded), until publish returns
// false or stop is called; stop waits for the call in flight.
func publishRandomly(seed uint64, publish func(evs []eventline.Event) bool) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		prng := rand.New(rand.NewPCG(seed+1, seed))
		for n := 0; ; n++ {
			select {
			case <-done:
				return
			case <-time.After(time.Duration(5+prng.IntN(20)) * time.Millisecond): // publishing pace
			}
			var evs []eventline.Event
			for range 1 + prng.IntN(3) {
				e, err := eventline.NewJSONEvent("order.updated", "order", fmt.Sprintf("agg-%02d", prng.IntN(16)), map[string]int{"n": n})
				if err != nil {
					panic(err)
				}
				e.ID = eventline.NewEventID()
				evs = append(evs, e)
			}
			if !publish(evs) {
				return
			}
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
}

// publishAll publishes publishRandomly's events with the rig's producer,
// each call in its own transaction (Publish), until stop is called; after
// stop, published says how many events were published.
func (r *faultRig) publishAll(ctx context.Context, seed uint64) (stop func(), published func() int) {
	var total int
	stop = publishRandomly(seed, func(evs []eventline.Event) bool {
		if err := r.prod.Publish(ctx, r.env.Pool, evs...); err != nil {
			r.t.Errorf("publish: %v", err)
			return false
		}
		total += len(evs)
		return true
	})
	return stop, func() int { return total }
}

// verifyGroup runs admin/verify on the rig's schema for group, whose
// handler recorded its effects in the table effects, and returns the
// report and its JSON, for failure messages.
func (r *faultRig) verifyGroup(ctx context.Context, group, effects string) (*verify.Report, string) {
	r.t.Helper()
	rep, err := verify.Run(ctx, r.env.Pool, nil, verify.Config{
		Schema: r.env.Schema, Brokers: r.brokers, Groups: []string{group},
		EffectsQueries: map[string]string{group: `SELECT event_id, seq FROM ` + effects},
		Logger:         testLogger(),
	})
	require.NoError(r.t, err)
	text, err := json.MarshalIndent(rep, "", "  ")
	require.NoError(r.t, err)
	return rep, string(text)
}

// waitAllApplied waits up to two minutes for group to have applied total
// events, failing with verify's report when it has not.
func (r *faultRig) waitAllApplied(ctx context.Context, seed uint64, group, effects string, total int) {
	r.t.Helper()
	applied := func() int {
		return r.count(`SELECT count(*) FROM `+r.table("processed_events")+` WHERE consumer_group = $1 AND outcome = 'applied'`, group)
	}
	for deadline := time.Now().Add(2 * time.Minute); applied() < total; {
		if time.Now().After(deadline) {
			_, text := r.verifyGroup(ctx, group, effects)
			r.t.Fatalf("seed %d: %d of %d events applied two minutes after the faults; verify:\n%s", seed, applied(), total, text)
		}
		time.Sleep(50 * time.Millisecond) // polling interval
	}
}

// requireAppliedOnceInOrder checks the effects table (seq, event_id,
// aggregate_id, version): no event applied twice, and each aggregate's
// versions applied consecutively from 1.
func (r *faultRig) requireAppliedOnceInOrder(seed uint64, effects string) {
	r.t.Helper()
	require.Zero(r.t, r.count(`SELECT count(*) FROM (SELECT event_id FROM `+effects+` GROUP BY 1 HAVING count(*) > 1) d`), "seed %d: an event applied twice", seed)
	require.Zero(r.t, r.count(`SELECT count(*) FROM (SELECT aggregate_id, version, lag(version) OVER (PARTITION BY aggregate_id ORDER BY seq) AS prev FROM `+effects+`) x WHERE prev IS NOT NULL AND version <> prev + 1`),
		"seed %d: versions applied out of order", seed)
	require.Zero(r.t, r.count(`SELECT count(*) FROM (SELECT aggregate_id, min(version) AS v FROM `+effects+` GROUP BY 1) x WHERE v <> 1`),
		"seed %d: an aggregate's first applied version is not 1", seed)
}

// requireVerifyClean logs verify's report and requires it to be OK with
// neither problems nor warnings, and to have counted events outbox events.
func (r *faultRig) requireVerifyClean(ctx context.Context, seed uint64, group, effects string, events int) {
	r.t.Helper()
	rep, text := r.verifyGroup(ctx, group, effects)
	r.t.Logf("verify:\n%s", text)
	require.True(r.t, rep.OK, "verify (seed %d):\n%s", seed, text)
	require.Zero(r.t, rep.Problems, "verify (seed %d):\n%s", seed, text)
	require.Zero(r.t, rep.Warnings, "verify (seed %d):\n%s", seed, text)
	require.EqualValues(r.t, events, rep.Outbox.Events)
}
