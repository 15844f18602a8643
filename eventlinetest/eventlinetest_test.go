package eventlinetest_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/eventlinetest"
	"github.com/eventline/eventline/middleware"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(testMain{m},
		// Sarama's metrics registry starts a process-wide meter ticker.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

// testMain closes the tests' second pools before goleak looks.
type testMain struct{ m *testing.M }

func (t testMain) Run() int {
	defer closeSecondPools()
	return t.m.Run()
}

// OrderPlaced is the payload of the order.placed events the tests use.
type OrderPlaced struct {
	AmountCents int64 `json:"amount_cents"`
}

// orders returns n orders for each of the customers: events of aggregate
// type customer, versions 1..n.
func orders(t testing.TB, customers []string, n int) []eventline.Event {
	t.Helper()
	var out []eventline.Event
	for v := 1; v <= n; v++ {
		for ci, c := range customers {
			e, err := eventline.NewJSONEvent("order.placed", "customer", c, OrderPlaced{AmountCents: int64(100*v + ci)})
			require.NoError(t, err)
			out = append(out, e)
		}
	}
	return out
}

var ordersSetup = eventlinetest.SQL(
	`CREATE TABLE orders (customer text, version bigint, amount_cents bigint, PRIMARY KEY (customer, version))`,
	`CREATE TABLE stats (customer text PRIMARY KEY, placed bigint NOT NULL)`,
)

// recordOrder is the part every handler variant shares: one row per
// order, written through the consumer transaction.
func recordOrder(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderPlaced) error {
	_, err := tx.Exec(ctx, `INSERT INTO orders VALUES ($1, $2, $3)`, e.AggregateID, e.AggregateVersion, o.AmountCents)
	return err
}

const countPlaced = `INSERT INTO stats VALUES ($1, 1) ON CONFLICT (customer) DO UPDATE SET placed = stats.placed + 1`

// countInTx records the order and counts it through the consumer
// transaction: idempotent under every fault.
func countInTx(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderPlaced) error {
	if err := recordOrder(ctx, tx, e, o); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, countPlaced, e.AggregateID)
	return err
}

// countOutside records the order and counts it on a connection of its
// own (the bug): a run that fails after counting and is retried counts
// twice.
func countOutside(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderPlaced) error {
	if err := recordOrder(ctx, tx, e, o); err != nil {
		return err
	}
	return outside(ctx, tx, countPlaced, e.AggregateID)
}

// secondPool returns a pool on the schema tx works in, other than the
// consumer's: what a handler uses when it writes through a second pool.
// (The kit gives every run its own schema; a real handler would hold its
// second pool from the start.)
func secondPool(ctx context.Context, tx pgx.Tx) (*pgxpool.Pool, error) {
	cfg := tx.Conn().Config()
	key := cfg.RuntimeParams["search_path"]
	if p, ok := secondPools.Load(key); ok {
		return p.(*pgxpool.Pool), nil
	}
	pcfg, err := pgxpool.ParseConfig("")
	if err != nil {
		return nil, err
	}
	pcfg.ConnConfig = cfg.Copy()
	pcfg.MaxConns = 2
	p, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, err
	}
	if old, loaded := secondPools.LoadOrStore(key, p); loaded {
		p.Close()
		return old.(*pgxpool.Pool), nil
	}
	return p, nil
}

var secondPools sync.Map

func closeSecondPools() {
	secondPools.Range(func(k, p any) bool {
		p.(*pgxpool.Pool).Close()
		secondPools.Delete(k)
		return true
	})
}

// outside runs a statement through a second pool, outside the consumer
// transaction: what a handler does when it writes through another pool or
// calls another service.
func outside(ctx context.Context, tx pgx.Tx, sql string, args ...any) error {
	p, err := secondPool(ctx, tx)
	if err != nil {
		return err
	}
	_, err = p.Exec(ctx, sql, args...)
	return err
}

func ordersCase(t testing.TB, h func(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderPlaced) error) eventlinetest.Case {
	return eventlinetest.Case{
		Setup:    ordersSetup,
		Handlers: map[string]consumer.HandlerFunc{"order.placed": eventlinetest.JSON(h)},
		Events:   orders(t, []string{"ada", "bob", "cy"}, 3),
		State: eventlinetest.Rows(`SELECT 'order', customer, version, amount_cents FROM orders
			UNION ALL SELECT 'placed', customer, placed, NULL FROM stats ORDER BY 1, 2, 3`),
	}
}

// TestCatchesACounterOutsideTheTransaction shows the kit catching a
// handler that is not idempotent: it counts orders on a connection of its
// own, so a run that fails after counting and is retried counts twice.
// The failure names the fault that breaks it and replays from its seed.
func TestCatchesACounterOutsideTheTransaction(t *testing.T) {
	c := ordersCase(t, countOutside)
	f, err := eventlinetest.Check(t.Context(), c)
	require.NoError(t, err)
	require.NotNil(t, f, "the kit must catch a counter written outside the transaction")
	t.Logf("the kit reports:\n%v", f)
	require.NoError(t, f.Err, "the handler did not fail: its effects differ")
	require.NotEqual(t, f.Want, f.Got)
	require.Len(t, f.Minimal, 1, "one failed first run is enough")
	require.Contains(t, f.Minimal[0], "first run for customer/")
	require.Contains(t, f.Error(), fmt.Sprintf("-eventlinetest.seed=%#x", f.Seed))
	require.Contains(t, f.Error(), "+ placed | ", "the diff shows the counter")

	// The seed replays the same schedule, and it fails the same way.
	c.Seed = f.Seed
	again, err := eventlinetest.Check(t.Context(), c)
	require.NoError(t, err)
	require.NotNil(t, again, "replaying seed %#x must fail again", f.Seed)
	require.Equal(t, f.Faults, again.Faults)
	require.Equal(t, f.Got, again.Got)
}

// TestPassesTheIdempotentHandler is the same handler counting through the
// consumer transaction: every fault class, every schedule, same effects.
func TestPassesTheIdempotentHandler(t *testing.T) {
	eventlinetest.Run(t, ordersCase(t, countInTx))
}

// balanceCase is an account whose handler reads the balance it updates.
func balanceCase(t testing.TB, readThroughTx bool) eventlinetest.Case {
	return eventlinetest.Case{
		Setup: eventlinetest.SQL(`CREATE TABLE balances (customer text PRIMARY KEY, cents bigint NOT NULL)`),
		Handlers: map[string]consumer.HandlerFunc{"order.placed": eventlinetest.JSON(func(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderPlaced) error {
			const read = `SELECT coalesce((SELECT cents FROM balances WHERE customer = $1), 0)`
			var cents int64
			var err error
			if readThroughTx {
				err = tx.QueryRow(ctx, read, e.AggregateID).Scan(&cents)
			} else {
				cents, err = readOutside(ctx, tx, read, e.AggregateID) // the bug
			}
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO balances VALUES ($1, $2) ON CONFLICT (customer) DO UPDATE SET cents = excluded.cents`,
				e.AggregateID, cents*2+o.AmountCents) // order matters
			return err
		})},
		Events: orders(t, []string{"ada", "bob"}, 4),
		State:  eventlinetest.Rows(`SELECT customer, cents FROM balances ORDER BY customer`),
	}
}

func readOutside(ctx context.Context, tx pgx.Tx, sql string, args ...any) (int64, error) {
	p, err := secondPool(ctx, tx)
	if err != nil {
		return 0, err
	}
	var v int64
	return v, p.QueryRow(ctx, sql, args...).Scan(&v)
}

// TestWithholdingCatchesAReadOutsideTheTransaction: a handler that reads
// the state it updates through another connection works while every
// event commits on its own, and breaks when a withheld version releases
// its parked successors in one transaction, or when a batch applies
// several events of its aggregate in one transaction (the ready runner's
// default).
func TestWithholdingCatchesAReadOutsideTheTransaction(t *testing.T) {
	c := balanceCase(t, false)
	c.Faults, c.Trials = eventlinetest.AllFaults&^(eventlinetest.Withholding|eventlinetest.Batches), 12
	eventlinetest.Run(t, c) // no other fault shows it

	c.Faults = eventlinetest.Withholding
	f, err := eventlinetest.Check(t.Context(), c)
	require.NoError(t, err)
	require.NotNil(t, f, "withholding must catch a read outside the transaction")
	require.Contains(t, f.Minimal[0], "is withheld until after")
	require.Contains(t, strings.Join(f.Deliveries, "\n"), "parked")

	c.Faults = eventlinetest.Batches
	f, err = eventlinetest.Check(t.Context(), c)
	require.NoError(t, err)
	require.NotNil(t, f, "batches must catch a read outside the transaction")
	require.Contains(t, f.Minimal[0], "delivered as one batch")
	require.Contains(t, strings.Join(f.Deliveries, "\n"), "batch of")

	fixed := balanceCase(t, true)
	fixed.Trials = 12
	eventlinetest.Run(t, fixed)
}

// TestReorderingCatchesACrossAggregateDependency: invoice numbers taken
// from a count of all invoices depend on the order of different
// aggregates, which nothing guarantees.
func TestReorderingCatchesACrossAggregateDependency(t *testing.T) {
	c := eventlinetest.Case{
		Setup: eventlinetest.SQL(`CREATE TABLE invoices (customer text, version bigint, no bigint)`),
		Handlers: map[string]consumer.HandlerFunc{"order.placed": func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
			_, err := tx.Exec(ctx, `INSERT INTO invoices SELECT $1, $2, count(*) + 1 FROM invoices`, e.AggregateID, e.AggregateVersion)
			return err
		}},
		Events: orders(t, []string{"ada", "bob", "cy"}, 2),
		State:  eventlinetest.Rows(`SELECT customer, version, no FROM invoices ORDER BY 1, 2`),
		Faults: eventlinetest.Reordering,
		Trials: 3,
	}
	f, err := eventlinetest.Check(t.Context(), c)
	require.NoError(t, err)
	require.NotNil(t, f, "reordering aggregates must change the invoice numbers")
	require.Equal(t, "reordering", f.Tests)
}

// TestKafkaModeRunsTheReadyRunner runs the same two handlers end to end:
// records published to Kafka with duplicates, withheld versions and
// redeliveries, consumed by consumer.New instances that join and leave
// the group, with handler failures retried by the runner.
func TestKafkaModeRunsTheReadyRunner(t *testing.T) {
	idempotent := ordersCase(t, countInTx)
	idempotent.Kafka = true
	eventlinetest.Run(t, idempotent)

	counter := ordersCase(t, countOutside)
	counter.Kafka, counter.Faults, counter.Trials = true, eventlinetest.HandlerErrors, 1
	// A seed whose one trial fails three first attempts: with a random one,
	// the "all at once" profile fails each event with probability 1/3, and
	// picks none of the nine about once in 40 runs.
	counter.Seed = 0x507c9541a40df308
	f, err := eventlinetest.Check(t.Context(), counter)
	require.NoError(t, err)
	require.NotNil(t, f, "the end-to-end mode must catch the counter too")
	t.Logf("the kit reports:\n%v", f)
	require.Contains(t, strings.Join(f.Deliveries, "\n"), "publish customer/ada v1")
}

// TestWatermillHandlerWithUpcasters tests a handler written for a team's
// own Router (transaction and event from the context) that reads version
// 2 of its payload, fed events written as versions 1 and 2.
func TestWatermillHandlerWithUpcasters(t *testing.T) {
	up, err := eventline.NewUpcasters(nil, eventline.Upcaster{Type: "order.placed", From: 1, Func: func(p []byte) ([]byte, error) {
		var v1 struct {
			Amount int64 `json:"amount"` // whole euros
		}
		if err := json.Unmarshal(p, &v1); err != nil {
			return nil, err
		}
		return json.Marshal(OrderPlaced{AmountCents: v1.Amount * 100})
	}})
	require.NoError(t, err)
	events := orders(t, []string{"ada", "bob"}, 3)
	for i := range events {
		if i%2 == 0 {
			events[i].Payload = []byte(fmt.Sprintf(`{"amount":%d}`, i+1))
		} else {
			events[i].SchemaVersion = 2
		}
	}
	eventlinetest.Run(t, eventlinetest.Case{
		Setup: ordersSetup,
		Handler: func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx, ok := middleware.TxFromContext(ctx)
			if !ok {
				return nil, middleware.ErrNoTx
			}
			e, ok := middleware.EventFromContext(ctx)
			if !ok {
				return nil, errors.New("no event in the context")
			}
			o, err := eventline.DecodePayload[OrderPlaced](e)
			if err != nil {
				return nil, middleware.Permanent(err)
			}
			return nil, recordOrder(ctx, tx, e, o)
		},
		Upcasters: up,
		Events:    events,
		State:     eventlinetest.Rows(`SELECT customer, version, amount_cents FROM orders ORDER BY 1, 2`),
		Trials:    8,
	})
}

// fakeT records what Run reports.
type fakeT struct {
	ctx    context.Context
	failed string
}

func (f *fakeT) Helper()                           {}
func (f *fakeT) Name() string                      { return "TestBilling/duplicates" }
func (f *fakeT) Context() context.Context          { return f.ctx }
func (f *fakeT) Fatalf(format string, args ...any) { f.failed = fmt.Sprintf(format, args...) }

// TestRunFailsTheTestWithTheReplayCommand checks what a user sees: Run
// fails the test with a message that replays the schedule by test name
// and seed.
func TestRunFailsTheTestWithTheReplayCommand(t *testing.T) {
	c := ordersCase(t, func(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderPlaced) error {
		if err := recordOrder(ctx, tx, e, o); err != nil {
			return err
		}
		return outside(ctx, tx, countPlaced, e.AggregateID)
	})
	c.Faults = eventlinetest.HandlerErrors
	ft := &fakeT{ctx: t.Context()}
	eventlinetest.Run(ft, c)
	require.Contains(t, ft.failed, "replay: go test -run '^TestBilling$/^duplicates$' -eventlinetest.seed=0x")
	require.Contains(t, ft.failed, "the handler's first run for customer/")
}

// TestCaseErrorsSayWhatToFix checks the errors for cases the kit cannot
// run.
func TestCaseErrorsSayWhatToFix(t *testing.T) {
	h := map[string]consumer.HandlerFunc{"order.placed": func(context.Context, pgx.Tx, eventline.Event) error { return nil }}
	state := eventlinetest.Rows(`SELECT 1`)
	gap := orders(t, []string{"ada"}, 3)
	gap[1].AggregateVersion, gap[2].AggregateVersion = 3, 2
	for name, tc := range map[string]struct {
		c    eventlinetest.Case
		want string
	}{
		"no state":     {eventlinetest.Case{Handlers: h, Events: orders(t, []string{"a"}, 1)}, "Case.State is nil"},
		"no handler":   {eventlinetest.Case{State: state, Events: orders(t, []string{"a"}, 1)}, "give the handler under test"},
		"no events":    {eventlinetest.Case{State: state, Handlers: h}, "Case.Events is empty"},
		"out of order": {eventlinetest.Case{State: state, Handlers: h, Events: gap}, "list each aggregate's versions in order"},
		"unknown type": {eventlinetest.Case{State: state, Handlers: map[string]consumer.HandlerFunc{"x": h["order.placed"]}, Events: orders(t, []string{"a"}, 1)},
			`type "order.placed", which has no handler`},
		"bad setup": {eventlinetest.Case{State: state, Handlers: h, Events: orders(t, []string{"a"}, 1), Setup: eventlinetest.SQL(`CREATE TABLE`)}, "Case.Setup: CREATE TABLE"},
		"failing handler": {eventlinetest.Case{State: state, Events: orders(t, []string{"a"}, 1),
			Handlers: map[string]consumer.HandlerFunc{"order.placed": func(context.Context, pgx.Tx, eventline.Event) error { return errors.New("boom") }}},
			"the handler fails on customer/a v1 (order.placed) when each event is applied once, in order, without faults: boom"},
	} {
		f, err := eventlinetest.Check(t.Context(), tc.c)
		require.Nil(t, f, name)
		require.ErrorContains(t, err, tc.want, name)
	}
}

// TestSetupRowsAndSequencesAreRestoredForEveryRun: rows Setup inserts,
// across a foreign key, and the sequences behind serial columns, are what
// every run starts from.
func TestSetupRowsAndSequencesAreRestoredForEveryRun(t *testing.T) {
	eventlinetest.Run(t, eventlinetest.Case{
		Setup: eventlinetest.SQL(
			`CREATE TABLE customers (name text PRIMARY KEY, tier text NOT NULL)`,
			`CREATE TABLE invoices (no serial PRIMARY KEY, customer text NOT NULL REFERENCES customers, version bigint NOT NULL, UNIQUE (customer, version))`,
			`INSERT INTO customers VALUES ('ada', 'gold'), ('bob', 'basic')`,
			`INSERT INTO invoices (customer, version) VALUES ('ada', 0)`,
		),
		Handlers: map[string]consumer.HandlerFunc{"order.placed": func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
			_, err := tx.Exec(ctx, `INSERT INTO invoices (customer, version) VALUES ($1, $2)`, e.AggregateID, e.AggregateVersion)
			return err
		}},
		Events: orders(t, []string{"ada"}, 3), // one aggregate: invoice numbers follow its versions
		State: eventlinetest.Rows(`SELECT c.name, c.tier, i.no, i.version FROM customers c LEFT JOIN invoices i ON i.customer = c.name
			ORDER BY 1, 4`),
		Faults: eventlinetest.Duplicates | eventlinetest.Crashes | eventlinetest.Rebalances,
		Trials: 6,
	})
}

// TestCaseWithAnEventIDTwiceIsRefused: two events of a Case with one id
// (an event copied for a second aggregate, say) were applied twice by the
// reference run and once by eventline, which refuses the second as an id
// conflict, and the kit reported that difference as the handler's fault.
// Check refuses the Case instead, naming both events.
func TestCaseWithAnEventIDTwiceIsRefused(t *testing.T) {
	c := ordersCase(t, func(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderPlaced) error {
		_, err := tx.Exec(ctx, `INSERT INTO orders VALUES ($1, $2, $3)`, e.AggregateID, e.AggregateVersion, o.AmountCents)
		return err
	})
	c.Events = orders(t, []string{"ada", "bob"}, 1)
	c.Events[0].ID = eventline.NewEventID()
	c.Events[1].ID = c.Events[0].ID
	f, err := eventlinetest.Check(t.Context(), c)
	require.Nil(t, f)
	require.ErrorContains(t, err, "Case.Events[1] has the id")
	require.ErrorContains(t, err, "of Case.Events[0]")
}
