package eventlinetest

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/middleware"
)

// kit is a prepared Case: defaults filled in, events numbered and encoded.
type kit struct {
	Case
	testName string
	// msgs[i] is Events[i] encoded as the relay publishes it.
	msgs []*message.Message
	// aggOf[i] is the index of Events[i]'s aggregate, in order of first
	// appearance; aggs[a] lists that aggregate's events in order.
	aggOf []int
	aggs  [][]int
	// inner is the handler under test as a Watermill handler expecting
	// the transaction and the event in the message context.
	inner message.HandlerFunc
	// env is the schema every run uses, reset before each.
	env *schemaEnv
}

// prepare validates c, fills in defaults and numbers the events.
func prepare(c Case, testName string) (*kit, error) {
	switch {
	case c.State == nil:
		return nil, errors.New("eventlinetest: Case.State is nil: give a function that reads the handler's effects back (see eventlinetest.Rows)")
	case c.Handler == nil && len(c.Handlers) == 0:
		return nil, errors.New("eventlinetest: Case.Handlers and Case.Handler are both empty: give the handler under test")
	case c.Handler != nil && len(c.Handlers) > 0:
		return nil, errors.New("eventlinetest: set Case.Handlers or Case.Handler, not both")
	case len(c.Events) == 0:
		return nil, errors.New("eventlinetest: Case.Events is empty: list the events to deliver")
	case c.Faults&^AllFaults != 0:
		return nil, fmt.Errorf("eventlinetest: Case.Faults has unknown bits %#x: combine the Fault constants", uint(c.Faults&^AllFaults))
	case c.Trials < 0:
		return nil, fmt.Errorf("eventlinetest: Case.Trials is %d; use a positive count (0 means the default)", c.Trials)
	case c.TrialTimeout < 0:
		return nil, fmt.Errorf("eventlinetest: Case.TrialTimeout is %s; it must be positive", c.TrialTimeout)
	}
	for t, fn := range c.Handlers {
		if fn == nil {
			return nil, fmt.Errorf("eventlinetest: Case.Handlers[%q] is nil", t)
		}
	}
	c.Faults = cmp.Or(c.Faults, AllFaults)
	c.Group = cmp.Or(c.Group, DefaultGroup)
	c.TrialTimeout = cmp.Or(c.TrialTimeout, DefaultTrialTimeout)
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	c.DatabaseURL = databaseURL(c.DatabaseURL)
	c.Trials = trialsOverride(c.Trials)
	if c.Trials == 0 {
		c.Trials = DefaultTrials
		if c.Kafka {
			c.Trials = DefaultKafkaTrials
		}
	}

	k := &kit{testName: testName}
	events := slices.Clone(c.Events)
	last := map[[2]string]int64{}
	aggIndex := map[[2]string]int{}
	ids := map[string]int{}
	for i := range events {
		e := &events[i]
		key := [2]string{e.AggregateType, e.AggregateID}
		if e.ID == "" {
			e.ID = eventline.NewEventID()
		}
		if j, dup := ids[e.ID]; dup {
			// The reference run would apply both, eventline the first
			// only: the difference would be blamed on the handler.
			return nil, fmt.Errorf("eventlinetest: Case.Events[%d] has the id %q of Case.Events[%d]: give each event its own id (or leave ID empty)", i, e.ID, j)
		}
		ids[e.ID] = i
		e.AggregateVersion = cmp.Or(e.AggregateVersion, last[key]+1)
		prev := cmp.Or(e.PreviousVersion, e.AggregateVersion-1)
		if prev != last[key] {
			return nil, fmt.Errorf("eventlinetest: Case.Events[%d] (%s %s/%s v%d) follows version %d, but the version listed before it is %d: "+
				"list each aggregate's versions in order, without gaps (the kit does the reordering)",
				i, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion, prev, last[key])
		}
		last[key] = e.AggregateVersion
		a, ok := aggIndex[key]
		if !ok {
			a = len(k.aggs)
			aggIndex[key] = a
			k.aggs = append(k.aggs, nil)
		}
		k.aggOf = append(k.aggOf, a)
		k.aggs[a] = append(k.aggs[a], i)
		if len(c.Handlers) > 0 && c.Handlers[e.Type] == nil && !slices.Contains(c.Ignore, e.Type) {
			return nil, fmt.Errorf("eventlinetest: Case.Events[%d] has type %q, which has no handler in Case.Handlers: add one, or list the type in Case.Ignore", i, e.Type)
		}
		msg, err := eventline.Encode(*e)
		if err != nil {
			return nil, fmt.Errorf("eventlinetest: Case.Events[%d]: %w", i, err)
		}
		back, err := eventline.Decode(msg)
		if err != nil {
			return nil, fmt.Errorf("eventlinetest: Case.Events[%d]: %w", i, err)
		}
		*e = back
		k.msgs = append(k.msgs, msg)
	}
	c.Events = events
	k.Case = c
	k.inner = k.handler()
	return k, nil
}

// handler returns the handler under test as the eventline middleware
// calls it: with the transaction and the event in the message context.
// Runner-style handlers are dispatched by event type after upcasting, as
// the ready runner does.
func (k *kit) handler() message.HandlerFunc {
	if k.Handler != nil {
		if k.Upcasters == nil {
			return k.Handler
		}
		return func(msg *message.Message) ([]*message.Message, error) {
			e, ok := middleware.EventFromContext(msg.Context())
			if !ok {
				return nil, errors.New("eventlinetest: no event in the message context")
			}
			m, err := delivery.Upcast(k.Upcasters, msg, e)
			if err != nil {
				return nil, middleware.Permanent(err)
			}
			return k.Handler(m)
		}
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, ok := middleware.TxFromContext(ctx)
		if !ok {
			return nil, middleware.ErrNoTx
		}
		e, ok := middleware.EventFromContext(ctx)
		if !ok {
			return nil, errors.New("eventlinetest: no event in the message context")
		}
		fn := k.Handlers[e.Type]
		if fn == nil {
			if slices.Contains(k.Ignore, e.Type) {
				return nil, nil
			}
			return nil, middleware.Permanent(&consumer.UnknownEventTypeError{Type: e.Type, Group: k.Group})
		}
		u, err := k.Upcasters.Upcast(e)
		if err != nil {
			return nil, middleware.Permanent(err)
		}
		if u.SchemaVersion != e.SchemaVersion {
			ctx = delivery.WithEvent(ctx, u)
		}
		return nil, fn(ctx, tx, u)
	}
}

// message returns a fresh copy of event i's message, as a broker delivers
// it again, with ctx.
func (k *kit) message(ctx context.Context, i int) *message.Message {
	m := k.msgs[i]
	c := message.NewMessage(m.UUID, slices.Clone(m.Payload))
	for key, v := range m.Metadata {
		c.Metadata.Set(key, v)
	}
	c.SetContext(ctx)
	return c
}

// label names event i in reports: "order/o-1 v2 (order.paid)".
func (k *kit) label(i int) string {
	e := k.Events[i]
	return fmt.Sprintf("%s/%s v%d (%s)", e.AggregateType, e.AggregateID, e.AggregateVersion, e.Type)
}

// reference applies every event once, in the listed order, by calling the
// handler directly in one transaction per event, from the state after
// Setup, and
// returns the state State reads afterwards.
func (k *kit) reference(ctx context.Context) (any, error) {
	ctx, cancel := context.WithTimeout(ctx, k.TrialTimeout)
	defer cancel()
	if err := k.env.reset(ctx); err != nil {
		return nil, err
	}
	for i := range k.Events {
		if err := k.applyDirectly(ctx, i); err != nil {
			return nil, fmt.Errorf("eventlinetest: the handler fails on %s when each event is applied once, in order, without faults: %w", k.label(i), err)
		}
	}
	want, err := k.env.read(ctx, k.State)
	if err != nil {
		return nil, fmt.Errorf("eventlinetest: Case.State: %w", err)
	}
	return want, nil
}

// applyDirectly runs the handler for event i in a transaction of its own,
// without the eventline middleware, and commits.
func (k *kit) applyDirectly(ctx context.Context, i int) error {
	tx, err := k.env.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	hctx := delivery.WithEvent(delivery.WithTx(ctx, tx), k.Events[i])
	if _, err := k.inner(k.message(hctx, i)); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	delivery.RunAfterCommit(hctx)
	return nil
}

// seeds returns the trial seeds, and whether they replay a given seed.
// Each seed's low byte names its profile, so that a seed alone replays
// its schedule.
func (k *kit) seeds() ([]uint64, bool) {
	if s := k.replaySeed(); s != 0 {
		return []uint64{s}, true
	}
	// Direct trials test each class alone first, then alternate random
	// mixes with every class at once; end-to-end trials (few and slow)
	// use every class at once.
	var profiles []profile
	if !k.Kafka {
		for _, p := range faultClasses {
			if k.Faults&p.fault != 0 {
				profiles = append(profiles, p.id)
			}
		}
	}
	base := randomSeed()
	seeds := make([]uint64, k.Trials)
	for i := range seeds {
		p := profileAll
		switch {
		case i < len(profiles):
			p = profiles[i]
		case !k.Kafka && (i-len(profiles))%2 == 0:
			p = profileMixed
		}
		seeds[i] = mix(base+uint64(i))&^0xff | uint64(p)
	}
	return seeds, false
}

func (k *kit) replaySeed() uint64 {
	if k.Seed != 0 {
		return k.Seed
	}
	for _, s := range []string{*seedFlag, os.Getenv(SeedEnv)} {
		if v, err := strconv.ParseUint(s, 0, 64); err == nil && v != 0 {
			return v
		}
	}
	return 0
}

func trialsOverride(n int) int {
	if *trialsFlag > 0 {
		return *trialsFlag
	}
	if v, err := strconv.Atoi(os.Getenv(TrialsEnv)); err == nil && v > 0 {
		return v
	}
	return n
}

func randomSeed() uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:])
}

// mix is splitmix64's finalizer: consecutive inputs give unrelated seeds.
func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}
