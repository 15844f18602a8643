package eventlinetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/middleware"
)

// maxAttempts bounds how often one delivery is tried when the handler
// fails on its own (an injected failure does not count): the runner would
// retry with backoff and then dead-letter.
const maxAttempts = 3

// finalSweeps bounds the sweeper passes after a schedule, which release
// parked events whose release failed during it.
const finalSweeps = 3

// parkTimeout keeps the sweeper from ever skipping a gap during a trial:
// every withheld version is released, so nothing should be given up on.
const parkTimeout = 24 * time.Hour

// errInjected is the error a HandlerErrors fault returns after the
// handler ran.
var errInjected = errors.New("eventlinetest: injected failure after the handler ran (HandlerErrors fault); the transaction rolls back and the event is retried")

// result is what one trial showed.
type result struct {
	// trace lists what happened, one line per delivery or fault.
	trace []string
	// err is a failure during the schedule (the handler failed where the
	// reference did not, events left parked…).
	err error
	// got is the state State read after the schedule.
	got      any
	mismatch bool
}

func (r *result) failed() bool { return r.err != nil || r.mismatch }

// runDirect runs one schedule by delivering the events to the eventline
// middleware directly, from the state after Setup, and compares the state
// after it with want.
func (k *kit) runDirect(ctx context.Context, s schedule, want any) (*result, error) {
	ctx, cancel := context.WithTimeout(ctx, k.TrialTimeout)
	defer cancel()
	if err := k.env.reset(ctx); err != nil {
		return nil, err
	}
	st, err := store.New(k.env.name)
	if err != nil {
		return nil, err
	}
	sim := &sim{kit: k, s: s, rng: s.rng(), inject: k.newInjector(s), store: st}
	if err := sim.run(ctx); err != nil {
		return &result{trace: sim.trace, err: err}, nil
	}
	return k.compare(ctx, want, sim.trace), nil
}

// compare reads the state after a schedule and compares it with want.
func (k *kit) compare(ctx context.Context, want any, trace []string) *result {
	got, err := k.env.read(ctx, k.State)
	if err != nil {
		return &result{trace: trace, err: fmt.Errorf("Case.State failed after the schedule: %w", err)}
	}
	return &result{trace: trace, got: got, mismatch: !reflect.DeepEqual(want, got)}
}

// sim is one trial in progress: consumer instances sharing one schema.
type sim struct {
	*kit
	s      schedule
	rng    *rand.Rand
	inject *injector
	store  *store.Store // to read what is still parked

	mu        sync.Mutex
	trace     []string
	instances int
}

// instance is one consumer process: its own middleware (gate, handler
// registry, sweeper) over the shared schema, and its own metrics, read to
// tell what became of each delivery.
type instance struct {
	id  int
	el  *middleware.Eventline
	h   message.HandlerFunc
	reg *prometheus.Registry
}

func (s *sim) newInstance() (*instance, error) {
	s.instances++
	reg := prometheus.NewRegistry()
	m, err := middleware.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	el, err := middleware.New(s.env.pool, middleware.Config{
		Group: s.Group, Schema: s.env.name,
		ParkTimeout: parkTimeout, Logger: s.Logger, Metrics: m,
		// A failed release is retried by the next sweep, not after a
		// backoff: the schedules' sweeps stand for the passage of time.
		ReleaseBackoff: eventline.Backoff{Initial: time.Microsecond, Max: time.Microsecond},
	})
	if err != nil {
		return nil, fmt.Errorf("eventlinetest: %w", err)
	}
	return &instance{id: s.instances, el: el, h: el.MiddlewareFor(handlerName)(s.inject.wrap(s.inner)), reg: reg}, nil
}

// handlerName is the handler the instances wrap; deliveries name none, so
// the sweeper finds it as the only handler each middleware wraps.
const handlerName = "eventlinetest"

// runsKey carries a delivery's list of handler runs through the context.
type runsKey struct{}

type runList struct {
	mu     sync.Mutex
	runs   []string
	panics []string // events whose AfterCommit hook panicked
}

// injector makes the handler's first run for chosen events fail after it
// ran (HandlerErrors), registers an AfterCommit hook that panics for
// others (with Batches), and records, in the runList of the context, which
// events the handler ran for, including parked events released within a
// delivery.
type injector struct {
	// failFirst holds the events whose first handler run fails;
	// panicHook those whose first committed run's AfterCommit hook panics.
	failFirst, panicHook map[int]bool
	index                map[string]int

	// onRun, when set, also receives every run's note; onHookPanic the
	// label of every event whose hook panicked.
	onRun       func(note string)
	onHookPanic func(label string)

	mu       sync.Mutex
	runs     map[string]int
	panicked map[int]bool
}

func (k *kit) newInjector(s schedule) *injector {
	in := &injector{failFirst: map[int]bool{}, panicHook: map[int]bool{}, index: map[string]int{}, runs: map[string]int{}, panicked: map[int]bool{}}
	for _, f := range s.faults {
		switch f.kind {
		case HandlerErrors:
			in.failFirst[f.event] = true
		case hookPanics:
			in.panicHook[f.event] = true
		}
	}
	for i, e := range k.Events {
		in.index[e.ID] = i
	}
	return in
}

// run calls the handler for e through call.
func (in *injector) run(ctx context.Context, e eventline.Event, call func() error) error {
	in.mu.Lock()
	in.runs[e.ID]++
	first := in.runs[e.ID] == 1
	in.mu.Unlock()
	err := call()
	i, known := in.index[e.ID]
	note := fmt.Sprintf("v%d", e.AggregateVersion)
	if in.onRun != nil {
		defer func() { in.onRun(fmt.Sprintf("%s/%s %s", e.AggregateType, e.AggregateID, note)) }()
	}
	if err == nil && first && known && in.failFirst[i] {
		err = errInjected
		note += " (then an injected failure)"
	} else if err != nil {
		note += " (failed: " + firstLine(err.Error()) + ")"
	}
	if err == nil && known && in.panicHook[i] {
		label := fmt.Sprintf("%s/%s v%d", e.AggregateType, e.AggregateID, e.AggregateVersion)
		middleware.AfterCommit(ctx, func() {
			in.mu.Lock()
			done := in.panicked[i]
			in.panicked[i] = true
			in.mu.Unlock()
			if done {
				return
			}
			if l, ok := ctx.Value(runsKey{}).(*runList); ok {
				l.mu.Lock()
				l.panics = append(l.panics, label)
				l.mu.Unlock()
			}
			if in.onHookPanic != nil {
				in.onHookPanic(label)
			}
			panic("eventlinetest: injected panic in an AfterCommit hook of " + label + " (Batches fault)")
		})
	}
	if l, ok := ctx.Value(runsKey{}).(*runList); ok {
		l.mu.Lock()
		l.runs = append(l.runs, note)
		l.mu.Unlock()
	}
	return err
}

// wrap returns h with the injector around it.
func (in *injector) wrap(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		e, _ := middleware.EventFromContext(msg.Context())
		var out []*message.Message
		err := in.run(msg.Context(), e, func() error {
			var err error
			out, err = h(msg)
			return err
		})
		return out, err
	}
}

func (s *sim) note(format string, args ...any) {
	s.mu.Lock()
	s.trace = append(s.trace, fmt.Sprintf(format, args...))
	s.mu.Unlock()
}

// run executes the schedule: partitions are consumed record by record
// (or, from where a Batches fault starts, several records at once as one
// batch) by their owning instance, offsets committed now and then,
// sweeper passes run now and then, and crashes and rebalances happen
// before the deliveries the schedule names (right after a batch that
// took that delivery).
func (s *sim) run(ctx context.Context) error {
	logs := s.logs(s.s)
	np := len(logs)
	next, committed := make([]int, np), make([]int, np)
	owner := make([]*instance, np)
	first, err := s.newInstance()
	if err != nil {
		return err
	}
	for p := range owner {
		owner[p] = first
	}
	stops := s.s.stops(Crashes | Rebalances | Batches)
	remaining := func() []int {
		var ps []int
		for p := range logs {
			if next[p] < len(logs[p]) {
				ps = append(ps, p)
			}
		}
		return ps
	}
	delivered := 0
	for len(remaining()) > 0 {
		batch := 1
		for len(stops) > 0 && stops[0].after <= delivered+1 {
			f := stops[0]
			stops = stops[1:]
			switch f.kind {
			case Batches:
				batch = max(batch, f.size)
			case Crashes:
				inst, err := s.newInstance()
				if err != nil {
					return err
				}
				s.note("-- crash before delivery %d: instance %d starts and reads again from the committed offsets %v (read up to %v)",
					delivered+1, inst.id, committed, next)
				for p := range owner {
					owner[p], next[p] = inst, committed[p]
				}
			case Rebalances:
				p := f.partition
				old := owner[p]
				inst, err := s.newInstance()
				if err != nil {
					return err
				}
				owner[p] = inst
				s.note("-- rebalance before delivery %d: partition %d moves from instance %d to instance %d, which reads again from offset %d (read up to %d)",
					delivered+1, p, old.id, inst.id, committed[p], next[p])
				var wg sync.WaitGroup
				var oldErr error
				if next[p] < len(logs[p]) {
					inflight := logs[p][next[p]]
					wg.Go(func() { oldErr = s.deliver(ctx, old, inflight, "(in flight on the old owner)", s.note) })
				}
				next[p] = committed[p]
				var newErr error
				if next[p] < len(logs[p]) {
					newErr = s.deliver(ctx, inst, logs[p][next[p]], fmt.Sprintf("%d.", delivered+1), s.note)
					next[p]++
					delivered++
				}
				wg.Wait()
				if err := errors.Join(oldErr, newErr); err != nil {
					return err
				}
			}
		}
		ps := remaining()
		if len(ps) == 0 {
			break
		}
		p := ps[len(ps)-1]
		if !s.s.reverse {
			p = ps[s.rng.IntN(len(ps))]
		}
		n := min(batch, len(logs[p])-next[p])
		var err error
		if n > 1 {
			err = s.deliverBatch(ctx, owner[p], logs[p][next[p]:next[p]+n], delivered+1, p)
		} else {
			err = s.deliver(ctx, owner[p], logs[p][next[p]], fmt.Sprintf("%d.", delivered+1), s.note)
		}
		if err != nil {
			return err
		}
		next[p] += n
		delivered += n
		if s.rng.IntN(s.s.commitEvery) == 0 {
			committed[p] = next[p]
		}
		if s.rng.IntN(s.s.sweepEvery) == 0 {
			if err := s.sweep(ctx, owner[p]); err != nil {
				return err
			}
		}
	}
	last := owner[0]
	for range finalSweeps {
		n, err := s.store.CountParked(ctx, s.env.pool, s.Group)
		if err != nil {
			return fmt.Errorf("eventlinetest: count parked events: %w", err)
		}
		if n == 0 {
			return nil
		}
		if err := s.sweep(ctx, last); err != nil {
			return err
		}
	}
	parked, err := s.store.ListParked(ctx, s.env.pool, store.ParkedFilter{Group: s.Group})
	if err != nil {
		return fmt.Errorf("eventlinetest: list parked events: %w", err)
	}
	if len(parked) == 0 {
		return nil
	}
	var stuck []string
	for _, p := range parked {
		stuck = append(stuck, fmt.Sprintf("%s/%s v%d (%d failed releases, last: %s)", p.AggregateType, p.AggregateID, p.Version, p.ReleaseAttempts, p.LastError))
	}
	return fmt.Errorf("events are still parked after every version was delivered and %d sweeper passes: %s", finalSweeps, strings.Join(stuck, "; "))
}

// deliver hands event i to inst as a broker would, retrying (as the
// runner's retry middleware does) after a failure, and says what happened
// through note. In a batch (ctx carries a batch member) its
// first attempt runs with the batch, its retries on their own.
func (s *sim) deliver(ctx context.Context, inst *instance, i int, step string, note func(string, ...any)) error {
	_, batched := ctx.Value(batchMemberKey{}).(bool)
	for attempt := 1; ; attempt++ {
		runs := &runList{}
		before := counters(inst.reg)
		_, err := inst.h(s.message(context.WithValue(ctx, runsKey{}, runs), i))
		after := counters(inst.reg)
		if batched && attempt == 1 {
			before = nil // the counters move for the whole batch: its summary line tells them
		}
		outcome := describeOutcome(before, after, err, runs.runs, runs.panics)
		what := "deliver"
		if attempt > 1 {
			what = "retry"
		}
		note("%s %s %s → instance %d: %s", step, what, s.label(i), inst.id, outcome)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, errInjected):
		case middleware.IsPermanent(err):
			return fmt.Errorf("the handler failed permanently on %s, so the consumer would dead-letter it: %w", s.label(i), err)
		case attempt >= maxAttempts:
			return fmt.Errorf("the handler failed %d times on %s, so the consumer would dead-letter it: %w", attempt, s.label(i), err)
		}
	}
}

// batchMemberKey marks the context of a batch member's delivery.
type batchMemberKey struct{}

// deliverBatch hands the records recs of partition p to inst as the
// members of one batch, as the ready runner's lanes do: each
// member runs the chain on its own goroutine (retried on its own after a
// failure, as by the runner's retry middleware), the batch applies those
// that reach the middleware together. What each member did is noted in
// member order, after a line for the batch.
func (s *sim) deliverBatch(ctx context.Context, inst *instance, recs []int, first, p int) error {
	b := delivery.NewBatch()
	notes := make([][]string, len(recs))
	errs := make([]error, len(recs))
	before := counters(inst.reg)
	var wg sync.WaitGroup
	for j, i := range recs {
		mctx := context.WithValue(b.Add(ctx), batchMemberKey{}, true)
		note := func(format string, args ...any) { notes[j] = append(notes[j], "  "+fmt.Sprintf(format, args...)) }
		wg.Go(func() {
			defer b.Leave(j)
			errs[j] = s.deliver(mctx, inst, i, fmt.Sprintf("%d.", first+j), note)
		})
	}
	b.Seal()
	b.Run(ctx)
	wg.Wait()
	s.note("%d–%d. batch of %d records of partition %d → instance %d: %s", first, first+len(recs)-1, len(recs), p, inst.id,
		batchSummary(before, counters(inst.reg)))
	for _, ns := range notes {
		for _, n := range ns {
			s.note("%s", n)
		}
	}
	return errors.Join(errs...)
}

// sweep runs one sweeper pass on inst.
func (s *sim) sweep(ctx context.Context, inst *instance) error {
	runs := &runList{}
	before := counters(inst.reg)
	if err := inst.el.Sweep(context.WithValue(ctx, runsKey{}, runs)); err != nil {
		return fmt.Errorf("eventlinetest: sweeper pass: %w", err)
	}
	after := counters(inst.reg)
	released := int(after["parked_released_total"] - before["parked_released_total"])
	failed := int(after["parked_release_failures_total"] - before["parked_release_failures_total"])
	if released > 0 || failed > 0 || len(runs.runs) > 0 {
		panics := ""
		if len(runs.panics) > 0 {
			panics = "; the AfterCommit hook of " + strings.Join(runs.panics, ", ") + " panicked (recovered)"
		}
		s.note("-- sweeper pass on instance %d: released %d, failed %d; handler ran for %s%s", inst.id, released, failed, strings.Join(runs.runs, ", "), panics)
	}
	return nil
}

// counters reads the consumer counters of one instance.
func counters(reg *prometheus.Registry) map[string]float64 {
	out := map[string]float64{}
	families, err := reg.Gather()
	if err != nil {
		return out
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			if c := m.GetCounter(); c != nil {
				out[strings.TrimPrefix(f.GetName(), "eventline_consumer_")] += c.GetValue()
			}
		}
	}
	return out
}

// outcomes are the consumer counters (without their eventline_consumer_
// prefix) of which each delivery that ends moves exactly one, with what a
// batch's summary and a single delivery's outcome call them.
var outcomes = []struct{ counter, batch, single string }{
	{"events_applied_total", "applied", "applied"},
	{"events_duplicate_total", "duplicates", "duplicate, skipped"},
	{"events_stale_total", "stale", "stale, discarded"},
	{"events_parked_total", "parked", "parked"},
}

// batchSummary says what a batch's deliveries did altogether, from the
// counters before and after it.
func batchSummary(before, after map[string]float64) string {
	var parts []string
	say := func(counter, words string) {
		if n := int(after[counter] - before[counter]); n > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", words, n))
		}
	}
	for _, o := range outcomes {
		say(o.counter, o.batch)
	}
	say("parked_released_total", "released from parking")
	say("after_commit_panics_total", "AfterCommit hooks panicked (recovered)")
	if len(parts) == 0 {
		return "nothing committed"
	}
	return strings.Join(parts, ", ")
}

// describeOutcome says what one delivery did: whom the handler ran for,
// and, from the counters before and after (nil: not told, it ran in a
// batch), what became of the event.
func describeOutcome(before, after map[string]float64, err error, runs, panics []string) string {
	var parts []string
	if len(runs) > 0 {
		parts = append(parts, "handler ran for "+strings.Join(runs, ", "))
	} else {
		parts = append(parts, "handler did not run")
	}
	if len(panics) > 0 {
		parts = append(parts, "the AfterCommit hook of "+strings.Join(panics, ", ")+" panicked (recovered)")
	}
	if err != nil {
		parts = append(parts, "rolled back")
	}
	if before == nil || err != nil {
		return strings.Join(parts, "; ")
	}
	d := func(name string) int { return int(after[name] - before[name]) }
	for _, o := range outcomes {
		if d(o.counter) > 0 {
			parts = append(parts, o.single)
			break
		}
	}
	if n := d("parked_released_total"); n > 0 {
		parts = append(parts, fmt.Sprintf("released %d parked", n))
	}
	if n := d("parked_release_failures_total"); n > 0 {
		parts = append(parts, fmt.Sprintf("%d parked release failed and stays parked", n))
	}
	return strings.Join(parts, "; ")
}
