package bench

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// TestMain checks that the scenarios leave no goroutine behind.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// sarama's metrics registry starts a process-wide meter ticker.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

// tinySizes makes every scenario run in a few seconds: the smoke tests
// check that each scenario runs end to end and reports sane figures, not
// how fast anything is.
func tinySizes() *Sizes {
	return &Sizes{
		Producers: 2, ProducerPhase: 200 * time.Millisecond, Rounds: 1,
		RelayBacklog: 300, ConsumerBacklog: 150, ConsumerRounds: 1, SlowBacklog: 200,
		Rates: []int{50}, RatePhase: 500 * time.Millisecond,
		// Longer than the relay's RebalanceInterval (2 s): an idle relay
		// renews its leases at least once in it. In one second its queries
		// (renewals, 5 s safety polls whose phases can coincide) may all
		// fall outside the window, and the smoke test would read 0/s.
		IdleWindow: 3 * time.Second,
	}
}

func TestScenariosSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("talks to PostgreSQL and Kafka")
	}
	for _, name := range Scenarios {
		t.Run(name, func(t *testing.T) {
			var out, progress bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			rep, err := Run(ctx, Config{Sizes: tinySizes(), Scenarios: []string{name}, Out: &out, Progress: &progress})
			require.NoError(t, err, "progress:\n%s", progress.String())
			require.Len(t, rep.Results, 1)
			res := rep.Results[0]
			require.Equal(t, name, res.Scenario)
			require.NotEmpty(t, res.Rows)
			for _, row := range res.Rows {
				require.Greater(t, row.Ours, 0.0, "%s: %s", name, row.Metric)
				require.Greater(t, row.Base, 0.0, "%s: %s", name, row.Metric)
				require.Greater(t, row.Ratio(), 0.0, "%s: %s", name, row.Metric)
			}
			require.NotEmpty(t, res.Ratios)
			require.Contains(t, out.String(), "SCENARIO")
			for _, q := range res.Ratios {
				require.Greater(t, q.Value, 0.0, q.Name)
				prefix := name
				if name == EndToEndLatency {
					prefix = "end_to_end_" // end_to_end_cpu_per_event_at_…
				}
				require.True(t, strings.HasPrefix(q.Name, prefix), "ratio %s is named after its scenario", q.Name)
				require.Contains(t, out.String(), "ratio "+q.Name+"=")
			}
			if name != IdleQueries && name != ConsumerSlow {
				require.NotEmpty(t, res.Costs, "%s measures each stage's cost", name)
				require.Contains(t, out.String(), "RT/EV")
				require.Contains(t, out.String(), "note cost: ")
			}
			for _, c := range res.Costs {
				require.Positive(t, c.Events, "%s %s", c.Stage, c.Variant)
				require.Positive(t, c.RoundTrips, "%s %s: round trips", c.Stage, c.Variant)
				require.GreaterOrEqual(t, c.RoundTrips, c.Statements-c.Events*100, "%s %s", c.Stage, c.Variant)
				if c.Server && c.Stage != "relay" {
					require.Positive(t, c.Rows, "%s %s: rows written", c.Stage, c.Variant)
				}
				require.Equal(t, c.Server, c.GoCPUOK, "%s %s: this process's CPU is read with the server's figures", c.Stage, c.Variant)
				require.False(t, c.PGCPUOK && !c.Server, "%s %s: PostgreSQL's CPU only with the server's figures", c.Stage, c.Variant)
			}
			require.Contains(t, progress.String(), "== "+name)
		})
	}
}

func TestConfigRejectsUnknownScenario(t *testing.T) {
	_, err := Run(context.Background(), Config{Scenarios: []string{"nope"}, Out: &bytes.Buffer{}, Progress: &bytes.Buffer{}})
	require.ErrorContains(t, err, `unknown scenario "nope"`)
}

func TestSummarize(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	s := summarize(d)
	require.Equal(t, 100, s.n)
	require.Equal(t, 50*time.Millisecond, s.p50)
	require.Equal(t, 95*time.Millisecond, s.p95)
	require.Equal(t, 99*time.Millisecond, s.p99)
	require.Equal(t, 100*time.Millisecond, s.max)
	require.Equal(t, 50500*time.Microsecond, s.mean)
	require.Equal(t, summary{}, summarize(nil))
}

func TestReportWrite(t *testing.T) {
	rep := Report{Results: []Result{{
		Scenario: "relay_drain",
		Rows:     []Row{{Metric: "drain events/s", Ours: 9000, Base: 3000, Baseline: "plain", Target: "≥ 3.00"}},
		Ratios:   []Ratio{{Name: "relay_drain_throughput", Value: 3}},
		Notes:    []string{"a note"},
	}}}
	var b bytes.Buffer
	rep.Write(&b)
	out := b.String()
	require.Contains(t, out, "ratio relay_drain_throughput=3.00\n")
	require.Contains(t, out, "note relay_drain: a note")
	require.Regexp(t, `relay_drain\s+drain events/s\s+9000\s+3000\s+3.00\s+≥ 3.00: met\s+plain`, out)
	v, ok := rep.Ratio("relay_drain_throughput")
	require.True(t, ok)
	require.Equal(t, 3.0, v)
}

// TestTargetsSayMetOrUnmet: each target in the table says whether the run
// met it, on the ratio or, for "ours …" targets, on eventline's figure.
func TestTargetsSayMetOrUnmet(t *testing.T) {
	for _, c := range []struct {
		row  Row
		want string
	}{
		{Row{Ours: 9000, Base: 3000, Target: "≥ 3.00"}, "≥ 3.00: met"},
		{Row{Ours: 8000, Base: 3000, Target: "≥ 3.00 [#10]"}, "≥ 3.00 [#10]: UNMET"},
		{Row{Ours: 1.6, Base: 1, Target: "≤ 1.25; ≤ 1.50 [#10]"}, "≤ 1.25: UNMET; ≤ 1.50 [#10]: UNMET"},
		{Row{Ours: 1.3, Base: 1, Target: "≤ 1.25; ≤ 1.50 [#10]"}, "≤ 1.25: UNMET; ≤ 1.50 [#10]: met"},
		{Row{Ours: 18.9, Base: 1200, Target: "ours ≤ 100 ms; ours ≤ 20 ms [#10]"}, "ours ≤ 100 ms: met; ours ≤ 20 ms [#10]: met"},
		{Row{Ours: 23, Base: 1200, Target: "ours ≤ 20 ms [#10]"}, "ours ≤ 20 ms [#10]: UNMET"},
		{Row{Ours: 4, Base: 300, Target: "ours ≤ 20/s"}, "ours ≤ 20/s: met"},
		{Row{Ours: 4, Base: 300, Target: "fast"}, "fast"},
		{Row{Ours: 4, Base: 300}, "-"},
	} {
		require.Equal(t, c.want, c.row.targetVerdict(), "%+v", c.row)
	}
}

func TestCPUBetween(t *testing.T) {
	a := cpuTimes{total: 1000, idle: 600}
	b := cpuTimes{total: 2000, idle: 850}
	u := cpuBetween(a, b)
	require.InDelta(t, 0.75, u.busy, 1e-9)
	require.Greater(t, u.cores, 0.0)
	require.Equal(t, cpuUse{}, cpuBetween(b, a))
	_, ok := readCPU()
	require.True(t, ok, "this machine has /proc/stat")
	require.NotEqual(t, "n/a", loadAvg())
}

func TestOffsetTrackerCommitsTheLowestUnfinishedOffset(t *testing.T) {
	tr := &offsetTracker{done: map[int64]bool{}}
	for o := int64(10); o < 15; o++ {
		tr.add(o)
	}
	var marks []int64
	mark := func(next int64) { marks = append(marks, next) }
	tr.finish([]int64{12, 13}, mark) // a lane ahead of 10 and 11
	require.Empty(t, marks, "nothing below 12 is finished")
	tr.finish([]int64{10}, mark)
	require.Equal(t, []int64{11}, marks)
	tr.finish([]int64{11}, mark)
	require.Equal(t, []int64{11, 14}, marks, "10–13 done: the next offset is 14")
	tr.finish([]int64{14}, mark)
	require.Equal(t, []int64{11, 14, 15}, marks)
	require.Empty(t, tr.pending)
	require.Empty(t, tr.done)
}

func TestWaitMarks(t *testing.T) {
	var n int64
	count := func() int64 { n++; return n }
	marks, err := waitMarks(context.Background(), time.Second, count, 1, 3, 5)
	require.NoError(t, err)
	require.Len(t, marks, 3)
	require.False(t, marks[1].Before(marks[0]))
	require.False(t, marks[2].Before(marks[1]))
	_, err = waitMarks(context.Background(), 10*time.Millisecond, func() int64 { return 0 }, 1)
	require.ErrorIs(t, err, errIncomplete)
}

func TestProcCPU(t *testing.T) {
	_, ok := procCPU(os.Getpid())
	require.True(t, ok, "this machine has /proc/<pid>/stat")
	// Run until this process has used a tick (run alone, it may not yet).
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		if d, _ := procCPU(os.Getpid()); d > 0 {
			break
		}
	}
	d, _ := procCPU(os.Getpid())
	require.Positive(t, d)
	_, ok = procCPU(-1)
	require.False(t, ok)
	p, ok := procStat(os.Getpid())
	require.True(t, ok)
	require.Equal(t, os.Getppid(), p.ppid)
	require.Equal(t, "bench.test", p.comm)
}

// dbEnv returns an env on the test database, closed when t ends; it skips
// t in -short mode.
func dbEnv(t *testing.T) *env {
	t.Helper()
	if testing.Short() {
		t.Skip("talks to PostgreSQL")
	}
	e, err := newEnv(context.Background(), Config{DatabaseURL: DatabaseURLFromEnv(), Progress: &bytes.Buffer{}, Out: &bytes.Buffer{}}.withDefaults())
	require.NoError(t, err)
	t.Cleanup(e.close)
	return e
}

// TestServerCPU reads the test database's server processes, when it runs
// on this machine.
func TestServerCPU(t *testing.T) {
	e := dbEnv(t)
	ctx := context.Background()
	if e.postmaster == 0 {
		t.Skipf("PostgreSQL's CPU cannot be read: %s", e.noServerCPU)
	}
	a, ok := readServerCPU(e.postmaster)
	require.True(t, ok)
	require.Contains(t, a.procs, e.postmaster)
	require.Greater(t, len(a.procs), 2, "the postmaster, a backend and background processes: %v", a.procs)
	var total time.Duration
	for _, d := range a.procs {
		total += d
	}
	require.Positive(t, total)
	// Burn a few ticks in a backend of a new connection that exits before
	// the second reading: its CPU is counted through the postmaster's
	// reaped children.
	conn, err := pgx.Connect(ctx, e.cfg.DatabaseURL)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `SELECT count(*) FROM generate_series(1, 3000000)`)
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))
	var b serverCPU
	require.Eventually(t, func() bool {
		b, ok = readServerCPU(e.postmaster)
		return ok && b.reaped > a.reaped
	}, 5*time.Second, 10*time.Millisecond, "the postmaster reaps the backend")
	require.GreaterOrEqual(t, serverCPUBetween(a, b), 10*time.Millisecond)
}

func TestServerCPUBetween(t *testing.T) {
	ms := time.Millisecond
	a := serverCPU{procs: map[int]time.Duration{1: 100 * ms, 2: 50 * ms, 3: 70 * ms}, reaped: 1000 * ms}
	b := serverCPU{
		procs:  map[int]time.Duration{1: 110 * ms, 2: 80 * ms, 4: 40 * ms}, // 3 exited, 4 started
		reaped: 1000*ms + 90*ms,                                            // 3 ended at 90 ms
	}
	require.Equal(t, (10+30+40+20)*ms, serverCPUBetween(a, b))
	require.Equal(t, time.Duration(0), serverCPUBetween(b, a), "never negative")
}

func TestCostTable(t *testing.T) {
	rep := Report{CostSource: "rows from somewhere", Results: []Result{{
		Scenario: "relay_drain",
		Costs: []Cost{
			{Stage: "relay", Variant: "eventline relay, 8 shards", Rate: 9000, Events: 1000, RoundTrips: 50, Statements: 60, Rows: 20, WALBytes: 300000, Server: true,
				GoCPU: 84 * time.Millisecond, PGCPU: 120400 * time.Microsecond, GoCPUOK: true, PGCPUOK: true},
			{Stage: "relay", Variant: "shared schema", Events: 10, RoundTrips: 30, Statements: 30},
		},
	}}}
	var b bytes.Buffer
	rep.Write(&b)
	out := b.String()
	require.Regexp(t, `STAGE\s+SCENARIO\s+VARIANT\s+RATE/S\s+EVENTS\s+RT/EV\s+STMTS/EV\s+ROWS/EV\s+WAL B/EV\s+GO µs/EV\s+PG µs/EV\n`, out)
	require.Regexp(t, `relay\s+relay_drain\s+eventline relay, 8 shards\s+9000\s+1000\s+0.05\s+0.06\s+0.02\s+300\s+84\s+120\n`, out)
	require.Regexp(t, `relay\s+relay_drain\s+shared schema\s+-\s+10\s+3.00\s+3.00\s+-\s+-\s+-\s+-\n`, out)
	require.Contains(t, out, "note cost: ")
	require.Contains(t, out, "rows from somewhere")
}

// TestQueryCounterCountsRoundTrips checks the tracer's arithmetic against
// a real server: a statement's first execution on a connection is a
// Prepare and an Exec (two round trips), later ones one; a Batch is one
// round trip for all its statements.
func TestQueryCounterCountsRoundTrips(t *testing.T) {
	e := dbEnv(t)
	ctx := context.Background()
	q := newQueryCounter()
	pool, err := e.openPool(ctx, 1, q)
	require.NoError(t, err)
	defer pool.Close()
	c0 := q.count()
	require.Equal(t, int64(1), c0.connects)
	_, err = pool.Exec(ctx, `SELECT $1::int`, 1)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `SELECT $1::int`, 2)
	require.NoError(t, err)
	c1 := q.count().sub(c0)
	require.Equal(t, int64(3), c1.roundTrips(), "prepare + 2 executions: %+v", c1)
	require.Equal(t, int64(2), c1.statements())
	b := &pgx.Batch{}
	for i := range 5 {
		b.Queue(`SELECT $1::int`, i)
	}
	require.NoError(t, pool.SendBatch(ctx, b).Close())
	c2 := q.count().sub(c0).sub(c1)
	require.Equal(t, int64(1), c2.roundTrips(), "%+v", c2)
	require.Equal(t, int64(5), c2.statements())
}
