package eventlinetest

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/middleware"
)

// Defaults for [Case].
const (
	// DefaultTrials is how many fault schedules a Case runs: one per fault
	// class, then random mixes of them and schedules with all of them.
	DefaultTrials = 30
	// DefaultKafkaTrials is how many schedules a Case with Kafka set runs
	// end to end, each with every fault class.
	DefaultKafkaTrials = 2
	// DefaultGroup is the consumer group the handlers run in.
	DefaultGroup = "eventlinetest"
	// DefaultTrialTimeout bounds one trial.
	DefaultTrialTimeout = 2 * time.Minute
)

// SeedEnv and the -eventlinetest.seed flag replay one schedule: set either
// to the seed a failure reported (decimal or 0x-prefixed hex). The flag
// wins.
const SeedEnv = "EVENTLINETEST_SEED"

// TrialsEnv and the -eventlinetest.trials flag override Case.Trials, e.g.
// for a longer run in CI.
const TrialsEnv = "EVENTLINETEST_TRIALS"

var (
	seedFlag   = flag.String("eventlinetest.seed", "", "replay the eventlinetest fault schedule with this seed (as reported by a failure)")
	trialsFlag = flag.Int("eventlinetest.trials", 0, "number of eventlinetest fault schedules per Case (overrides Case.Trials)")
)

// Fault is a class of delivery fault the kit injects. Combine them with |.
type Fault uint

const (
	// Duplicates delivers records again: every record twice in the
	// schedule that tests this class alone, some of them much later.
	Duplicates Fault = 1 << iota
	// Reordering delivers different aggregates in another order than they
	// were published: interleaved at random over several partitions, or
	// the last aggregate first.
	Reordering
	// Withholding holds a version of an aggregate back and releases it
	// after its successors, which arrive first and wait (are parked).
	Withholding
	// Crashes stops the consumer between a commit and the offset commit:
	// a fresh consumer instance reads again from the last committed
	// offsets, redelivering events whose effects are committed.
	Crashes
	// Rebalances moves a partition to a fresh consumer instance mid-stream
	// while the old one is still handling its event, and the new owner
	// reads again from the last committed offset.
	Rebalances
	// HandlerErrors makes the handler's first run for an event fail after
	// the handler ran: its transaction rolls back and the event is
	// retried. Effects written outside the transaction stay behind.
	HandlerErrors
	// Batches delivers runs of consecutive records of a partition as one
	// batch, as the ready runner does by default (consumer.Config
	// BatchSize): several events, of one aggregate or several, admitted
	// and applied in one transaction; with HandlerErrors, a member that
	// fails costs only itself (the members before it are applied again,
	// it is retried alone, the rest follow as a new batch). Some events'
	// AfterCommit hooks (registered by the kit next to the handler's own)
	// panic: the event stays applied and the other hooks run.
	Batches

	// AllFaults is every fault class; a zero Case.Faults means it.
	AllFaults = Duplicates | Reordering | Withholding | Crashes | Rebalances | HandlerErrors | Batches
)

// hookPanics is the kit's own fault kind for an event whose AfterCommit
// hook panics, injected with Batches (not a class of its own).
const hookPanics Fault = 1 << 31

// String lists the classes in f.
func (f Fault) String() string {
	var names []string
	for _, n := range faultClasses {
		if f&n.fault != 0 {
			names = append(names, n.name)
		}
	}
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, ", ")
}

// Case is one handler under test: its tables, its events, and how to read
// its effects back.
type Case struct {
	// DatabaseURL is the PostgreSQL to run against. Every run (the
	// reference and each trial) gets a schema of its own there, created,
	// migrated with eventline's migrations, set up with Setup, and dropped
	// afterwards; its connections have search_path set to it, so
	// unqualified table names in Setup, the handlers and State resolve to
	// that schema. Defaults to TEST_DATABASE_URL, then DATABASE_URL, then
	// DefaultDatabaseURL.
	DatabaseURL string
	// Setup creates the handler's tables (and any rows it expects) in a
	// new schema. See SQL for a list of statements.
	Setup func(ctx context.Context, tx pgx.Tx) error

	// Handlers are runner-style handlers by event type, as registered with
	// consumer.Handle (wrap a consumer.HandleJSON handler with JSON). Set
	// Handlers or Handler, not both.
	Handlers map[string]consumer.HandlerFunc
	// Handler is a Watermill handler as used on your own Router: the kit
	// runs it inside the eventline middleware, where it finds the
	// transaction and the event with middleware.TxFromContext and
	// middleware.EventFromContext.
	Handler message.HandlerFunc
	// Ignore lists event types that have no handler (consumer.Ignore).
	// Events of other types without a handler are an error.
	Ignore []string
	// Upcasters brings payloads to the current schema version before the
	// handlers run, as middleware.Config.Upcasters (so consumer.Config.Upcasters) does.
	Upcasters *eventline.Upcasters

	// Events are the events, in the order they were published. Each
	// aggregate's events must be listed in version order without a gap:
	// the kit does the reordering. An event without an aggregate version
	// gets the next one of its aggregate, as the producer would assign
	// it; an event without an ID gets one.
	Events []eventline.Event

	// State reads the handler's effects back, in a read-only transaction
	// on the run's schema. The kit compares its results with
	// reflect.DeepEqual, so select what the handler decides (amounts,
	// states, counts), ordered by a business key; leave out what differs
	// between correct runs (serial ids, now(), the interleaving of
	// different aggregates). See Rows. Required.
	State func(ctx context.Context, tx pgx.Tx) (any, error)

	// Faults are the fault classes to inject. Defaults to AllFaults.
	Faults Fault
	// Trials is how many fault schedules to run. The first ones each test
	// one fault class alone; the rest alternate random mixes of the
	// classes with schedules that have every class at once (with Kafka,
	// every trial has every class).
	// Defaults to DefaultTrials (30), or DefaultKafkaTrials (2) with
	// Kafka; the -eventlinetest.trials flag and EVENTLINETEST_TRIALS
	// override it.
	Trials int
	// Seed replays the one schedule a failure reported. Defaults to the
	// -eventlinetest.seed flag, then EVENTLINETEST_SEED; when none is
	// set, schedules are drawn from a random seed. A seed replays the same
	// deliveries, except that the two deliveries racing during a rebalance
	// may finish in either order (and, with Kafka, that the broker and the
	// consumers' timing decide the interleaving).
	Seed uint64

	// Kafka runs each trial end to end instead: the faulted schedule is
	// published to an in-process Kafka cluster (or the one in
	// KAFKA_BROKERS) and consumed by consumer.New instances with the
	// handlers, with retries, rebalances between instances, and
	// redeliveries of committed events. Slower, and its interleavings
	// depend on timing, so a seed replays the published schedule but not
	// always the exact deliveries.
	Kafka bool

	// Group is the consumer group. Defaults to DefaultGroup.
	Group string
	// TrialTimeout bounds one trial. Defaults to DefaultTrialTimeout (2m).
	TrialTimeout time.Duration
	// Logger receives eventline's and Watermill's logs. Defaults to
	// discarding them.
	Logger *slog.Logger
}

// JSON adapts a typed handler, as registered with consumer.HandleJSON, to
// Case.Handlers: the payload is decoded from JSON into a T first, and a
// payload that does not decode is a permanent error.
func JSON[T any](fn func(ctx context.Context, tx pgx.Tx, e eventline.Event, payload T) error) consumer.HandlerFunc {
	return func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		p, err := eventline.DecodePayload[T](e)
		if err != nil {
			return middleware.Permanent(fmt.Errorf("event %s (%s): %w", e.ID, e.Type, err))
		}
		return fn(ctx, tx, e, p)
	}
}

// SQL returns a Setup that runs the statements in order.
func SQL(statements ...string) func(context.Context, pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		for _, s := range statements {
			if _, err := tx.Exec(ctx, s); err != nil {
				return fmt.Errorf("%s: %w", firstLine(s), err)
			}
		}
		return nil
	}
}

// Rows returns a State that runs query and returns its rows, one string
// per row, the columns formatted with %v and separated by " | ". Order the
// rows by a business key; failures then show which rows differ.
func Rows(query string, args ...any) func(context.Context, pgx.Tx) (any, error) {
	return func(ctx context.Context, tx pgx.Tx) (any, error) {
		rows, err := tx.Query(ctx, query, args...)
		if err != nil {
			return nil, err
		}
		out := []string{}
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				rows.Close()
				return nil, err
			}
			cols := make([]string, len(vals))
			for i, v := range vals {
				cols[i] = fmt.Sprint(v)
			}
			out = append(out, strings.Join(cols, " | "))
		}
		return out, rows.Err()
	}
}

// TB is what Run needs from a test; *testing.T and *testing.B satisfy it.
type TB interface {
	Helper()
	Name() string
	Context() context.Context
	Fatalf(format string, args ...any)
}

// Run checks c and fails the test with the first fault schedule whose
// effects differ from applying each event once, in order, with the seed
// that replays it. See Check.
func Run(t TB, c Case) {
	t.Helper()
	f, err := check(t.Context(), c, t.Name())
	if err != nil {
		t.Fatalf("%v", err)
	}
	if f != nil {
		t.Fatalf("%v", f)
	}
}

// Check applies c.Events once, in order, calling the handler directly in
// one transaction per event, and reads the reference state with c.State.
// Then, for each trial, it delivers the events through the real eventline
// middleware (the ready runner, with Kafka set) under a schedule of faults
// drawn from the seed, and compares the state after it with the
// reference.
//
// It returns a *Failure for the first schedule whose state differs, or in
// which the handler failed where the reference did not, after searching
// for the smallest subset of that schedule's faults that still fails. It
// returns an error when it cannot run: an invalid Case, no database, or a
// Setup, handler or State that fails on the reference run.
func Check(ctx context.Context, c Case) (*Failure, error) {
	return check(ctx, c, "")
}

func check(ctx context.Context, c Case, testName string) (*Failure, error) {
	k, err := prepare(c, testName)
	if err != nil {
		return nil, err
	}
	sctx, cancel := context.WithTimeout(ctx, k.TrialTimeout)
	k.env, err = newSchema(sctx, k.DatabaseURL, k.Setup)
	cancel()
	if err != nil {
		return nil, err
	}
	defer k.env.close(ctx)
	want, err := k.reference(ctx)
	if err != nil {
		return nil, err
	}
	seeds, replay := k.seeds()
	if k.Kafka {
		return k.checkKafka(ctx, want, seeds, replay)
	}
	for i, seed := range seeds {
		s := k.schedule(seed)
		r, err := k.runDirect(ctx, s, want)
		if err != nil {
			return nil, err
		}
		if r.failed() {
			return k.failure(ctx, s, r, want, i, len(seeds), replay, k.runDirect)
		}
	}
	return nil, nil
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i] + " …"
	}
	return s
}
