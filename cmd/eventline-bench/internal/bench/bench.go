// Package bench runs eventline side by side with the designs it replaces:
// plain Watermill (watermill-sql's default PostgreSQL schema, one forwarder
// topic, the sync watermill-kafka publisher) and a hand-written outbox relay
// (status column, FOR UPDATE SKIP LOCKED, sync Sarama producer), against the
// real PostgreSQL and Kafka (kfake in-process unless KAFKA_BROKERS is set).
//
// Every scenario creates its own schemas and topics and drops them when it
// ends. Progress goes to Config.Progress; the result is one table, with
// eventline's figure and the baseline's side by side, a table of what each
// stage asked of PostgreSQL per event (round trips, statements, rows, WAL
// bytes), and one "ratio <name>=<x.xx>" line per figure (eventline ÷
// baseline).
//
// Every measured phase runs on warm pools (every connection open, its
// statements prepared and past PostgreSQL's first custom plans); the cold
// start is measured apart and reported as rows of its own. Designs that are
// compared alternate (end_to_end_latency interleaves them rate by rate), so
// a change in the machine's load hits both.
//
// Only ratios measured in the same run mean anything: absolute figures
// depend on the machine and on what else runs on it.
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"slices"
	"strings"
	"time"
)

// DefaultDatabaseURL is used when neither TEST_DATABASE_URL nor
// DATABASE_URL is set.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// Scenario names, in the order Run runs them.
const (
	ProducerOverhead = "producer_overhead"
	RelayDrain       = "relay_drain"
	ConsumerDrain    = "consumer_drain"
	ConsumerSlow     = "consumer_slow_handler"
	EndToEndLatency  = "end_to_end_latency"
	IdleQueries      = "idle_queries"
)

// Scenarios lists every scenario in run order.
var Scenarios = []string{ProducerOverhead, RelayDrain, ConsumerDrain, ConsumerSlow, EndToEndLatency, IdleQueries}

// Sizes scale the scenarios. FullSizes and QuickSizes are the two presets.
type Sizes struct {
	// Producers is the number of concurrent producers in producer_overhead
	// and the end-to-end producers' pool.
	Producers int
	// ProducerPhase is how long one producer_overhead phase (business tx
	// alone, or with PublishTx) runs; Rounds alternate the two.
	ProducerPhase time.Duration
	Rounds        int
	// RelayBacklog is the outbox backlog each relay_drain variant drains,
	// RelayRounds times (at least once), the variants alternating.
	RelayBacklog int
	RelayRounds  int
	// ConsumerBacklog is the Kafka backlog each consumer_drain variant
	// consumes, ConsumerRounds times, the variants alternating.
	ConsumerBacklog int
	ConsumerRounds  int
	// SlowBacklog is the one-partition backlog consumer_slow_handler
	// drains with 1 lane and with 16 (ConsumerRounds times).
	SlowBacklog int
	// Rates are the offered event rates (events/s) of end_to_end_latency,
	// each run for RatePhase after a one-second warm-up. The phase is long
	// enough that a pipeline that cannot keep up shows it in the latency
	// (a backlog grows by the shortfall times the phase).
	Rates     []int
	RatePhase time.Duration
	// IdleWindow is how long idle_queries counts queries.
	IdleWindow time.Duration
}

// FullSizes is the preset of `eventline-bench`.
func FullSizes() Sizes {
	return Sizes{
		Producers: 16, ProducerPhase: 5 * time.Second, Rounds: 3,
		RelayBacklog: 50_000, RelayRounds: 2, ConsumerBacklog: 50_000, ConsumerRounds: 2, SlowBacklog: 3_000,
		Rates: []int{100, 250, 500, 1000, 2000}, RatePhase: 15 * time.Second,
		IdleWindow: 30 * time.Second,
	}
}

// QuickSizes is the preset of `eventline-bench -quick`: the same scenarios
// with smaller backlogs and shorter phases, about four minutes in all
// (3 min 46 s with the machine loaded).
func QuickSizes() Sizes {
	return Sizes{
		Producers: 16, ProducerPhase: 3 * time.Second, Rounds: 1,
		RelayBacklog: 10_000, RelayRounds: 1, ConsumerBacklog: 10_000, ConsumerRounds: 1, SlowBacklog: 2_000,
		Rates: []int{100, 500, 1000}, RatePhase: 10 * time.Second,
		IdleWindow: 10 * time.Second,
	}
}

// Config configures Run.
type Config struct {
	// Quick selects QuickSizes instead of FullSizes.
	Quick bool
	// Sizes, when set, overrides the preset (tests use tiny sizes).
	Sizes *Sizes
	// Scenarios limits the run to these scenarios. Defaults to all.
	Scenarios []string
	// DatabaseURL is the PostgreSQL to run against. Defaults to
	// TEST_DATABASE_URL, then DATABASE_URL, then DefaultDatabaseURL.
	DatabaseURL string
	// Brokers are the Kafka brokers; empty, each scenario starts an
	// in-process kfake cluster. (The command reads KAFKA_BROKERS into its
	// -brokers flag, so an explicit -brokers "" still means kfake.)
	Brokers []string
	// BrokerPID is the process id of the (real) broker on this machine,
	// when known: end_to_end_latency then reports its CPU share beside the
	// pipeline's. eventline-bench reads it from KAFKA_BROKER_PID.
	BrokerPID int
	// ProfileDir, when set, receives a CPU profile per measured phase and
	// block and mutex profiles (cumulative) after each phase.
	ProfileDir string
	// Out receives the table and the ratio lines. Defaults to os.Stdout.
	Out io.Writer
	// Progress receives progress lines. Defaults to os.Stderr.
	Progress io.Writer
}

func (c Config) withDefaults() Config {
	if c.DatabaseURL == "" {
		c.DatabaseURL = DatabaseURLFromEnv()
	}
	if len(c.Scenarios) == 0 {
		c.Scenarios = Scenarios
	}
	if c.Out == nil {
		c.Out = os.Stdout
	}
	if c.Progress == nil {
		c.Progress = os.Stderr
	}
	return c
}

func (c Config) validate() error {
	for _, s := range c.Scenarios {
		if !slices.Contains(Scenarios, s) {
			return fmt.Errorf("bench: unknown scenario %q; choose from %s", s, strings.Join(Scenarios, ", "))
		}
	}
	return nil
}

func (c Config) sizes() Sizes {
	switch {
	case c.Sizes != nil:
		return *c.Sizes
	case c.Quick:
		return QuickSizes()
	}
	return FullSizes()
}

// BrokerPIDEnv names the environment variable eventline-bench reads
// Config.BrokerPID from: the process id of a real broker on this machine.
const BrokerPIDEnv = "KAFKA_BROKER_PID"

// DatabaseURLFromEnv returns TEST_DATABASE_URL, DATABASE_URL or
// DefaultDatabaseURL, the first that is set.
func DatabaseURLFromEnv() string {
	for _, k := range []string{"TEST_DATABASE_URL", "DATABASE_URL"} {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return DefaultDatabaseURL
}

// Row is one line of the table: eventline's figure next to a baseline's.
type Row struct {
	Scenario string
	// Metric says what is measured, with its unit.
	Metric string
	// Ours is eventline's figure; Base the baseline's.
	Ours, Base float64
	// Baseline names the baseline.
	Baseline string
	// Target is the goal for Ours ÷ Base, when there is one ("≥ 3.00").
	Target string
}

// Ratio is Ours ÷ Base of the row.
func (r Row) Ratio() float64 { return ratio(r.Ours, r.Base) }

// Ratio is one "ratio <name>=<x.xx>" line.
type Ratio struct {
	Name  string
	Value float64
}

// Result is what one scenario measured.
type Result struct {
	Scenario string
	Rows     []Row
	// Ratios are printed as "ratio <name>=<x.xx>"; the first is the
	// scenario's headline.
	Ratios []Ratio
	// Notes qualify the figures (sizes, settings, caveats).
	Notes []string
	// Costs are what each stage asked of PostgreSQL per event.
	Costs []Cost
}

// Report is the outcome of Run.
type Report struct {
	Results []Result
	Elapsed time.Duration
	// CostSource says where the costs' rows, WAL bytes and CPU times come
	// from.
	CostSource string
}

// Run runs the configured scenarios in order, writes the table and ratio
// lines to cfg.Out and returns what it measured. A scenario that fails stops
// the run; what it created is cleaned up first.
func Run(ctx context.Context, cfg Config) (Report, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return Report{}, err
	}
	start := time.Now()
	e, err := newEnv(ctx, cfg)
	if err != nil {
		return Report{}, err
	}
	defer e.close()
	e.progressf("eventline %s, PostgreSQL %s, Kafka %s, GOMAXPROCS %d, sizes %s", buildRevision(), e.pgVersion, e.kafkaName(), gomaxprocs(), describeSizes(e.sizes))
	if e.server.pgss != "" {
		e.progressf("rows and WAL per event from pg_stat_user_tables and %s", e.server.pgss)
	} else {
		e.progressf("rows per event from pg_stat_user_tables, WAL from pg_current_wal_lsn(): %s", e.server.why)
	}

	rep := Report{CostSource: e.server.describe() + "; " + e.describeCPUCosts()}
	for _, name := range Scenarios {
		if !slices.Contains(cfg.Scenarios, name) {
			continue
		}
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		e.progressf("== %s (load average %s)", name, loadAverage())
		res, err := scenarioFuncs[name](ctx, e)
		if err != nil {
			return rep, fmt.Errorf("bench %s: %w", name, err)
		}
		res.Scenario = name
		rep.Results = append(rep.Results, res)
	}
	rep.Elapsed = time.Since(start)
	e.progressf("done in %s (load average %s)", rep.Elapsed.Round(time.Second), loadAverage())
	rep.Write(cfg.Out)
	return rep, nil
}

var scenarioFuncs = map[string]func(context.Context, *env) (Result, error){
	ProducerOverhead: runProducerOverhead,
	RelayDrain:       runRelayDrain,
	ConsumerDrain:    runConsumerDrain,
	ConsumerSlow:     runConsumerSlowHandler,
	EndToEndLatency:  runEndToEndLatency,
	IdleQueries:      runIdleQueries,
}

// buildRevision returns the VCS revision the binary was built from, when
// the toolchain recorded it (go build does, go run does not).
func buildRevision() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "(revision not recorded)"
	}
	var rev, modified string
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value
		}
	}
	if rev == "" {
		return "(revision not recorded)"
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if modified == "true" {
		rev += "+dirty"
	}
	return rev
}

// loadAverage returns the 1, 5 and 15 minute load averages (Linux), to
// show when other work competed for the machine.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

func ratio(ours, base float64) float64 {
	if base == 0 {
		return 0
	}
	return ours / base
}

// errIncomplete reports a phase that did not see all its events in time.
var errIncomplete = errors.New("not every event arrived before the timeout")
