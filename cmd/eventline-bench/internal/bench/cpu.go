package bench

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// cpuTimes is the machine's CPU time from /proc/stat's "cpu" line, in
// clock ticks: all of it, and the idle part (idle + iowait).
type cpuTimes struct{ total, idle uint64 }

// readCPU reads /proc/stat; ok is false where there is none.
func readCPU() (cpuTimes, bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuTimes{}, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return cpuTimes{}, false
	}
	var t cpuTimes
	for i, s := range f[1:] {
		if i >= 8 { // guest and guest_nice are already counted in user and nice
			break
		}
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return cpuTimes{}, false
		}
		t.total += v
		if i == 3 || i == 4 { // idle, iowait
			t.idle += v
		}
	}
	return t, true
}

// cpuUse is the machine's CPU use between two readings: the busy share of
// all cores (0–1) and the cores that share amounts to. The machine's, not
// the process's: whatever else runs on it counts too.
type cpuUse struct {
	busy  float64
	cores float64
}

func cpuBetween(a, b cpuTimes) cpuUse {
	if b.total <= a.total {
		return cpuUse{}
	}
	busy := 1 - float64(b.idle-a.idle)/float64(b.total-a.total)
	return cpuUse{busy: busy, cores: busy * float64(runtime.NumCPU())}
}

// loadAvg returns /proc/loadavg's 1, 5 and 15 minute figures, or "n/a".
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "n/a"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "n/a"
	}
	return strings.Join(f[:3], " ")
}

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat's CPU times: 100 on
// every Linux platform Go supports.
const clockTicks = 100

// procInfo is what /proc/<pid>/stat says of a process.
type procInfo struct {
	comm string
	ppid int
	// cpu is the CPU time (user + system) the process has used; reaped
	// that of its children it has waited for (cutime + cstime).
	cpu, reaped time.Duration
}

// procStat reads /proc/<pid>/stat; ok is false where there is none.
func procStat(pid int) (procInfo, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procInfo{}, false
	}
	// The command name, in parentheses, may hold spaces: fields count
	// from after its closing parenthesis (state is field 3; ppid 4,
	// utime 14, stime 15, cutime 16, cstime 17).
	s := string(b)
	open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || end < open {
		return procInfo{}, false
	}
	f := strings.Fields(s[end+1:])
	if len(f) < 15 {
		return procInfo{}, false
	}
	var v [5]uint64
	for i, field := range []int{1, 11, 12, 13, 14} {
		if v[i], err = strconv.ParseUint(f[field], 10, 64); err != nil {
			return procInfo{}, false
		}
	}
	ticks := func(n uint64) time.Duration { return time.Duration(n) * time.Second / clockTicks }
	return procInfo{comm: s[open+1 : end], ppid: int(v[0]), cpu: ticks(v[1] + v[2]), reaped: ticks(v[3] + v[4])}, true
}

// procCPU returns the CPU time (user + system) process pid has used; ok
// is false where there is none.
func procCPU(pid int) (time.Duration, bool) {
	p, ok := procStat(pid)
	return p.cpu, ok
}

// findPostmaster returns the pid of the PostgreSQL server db is on when it
// runs on this machine: the parent of db's backend, if /proc shows that
// backend as a postgres process. Otherwise it returns 0 and why.
func findPostmaster(ctx context.Context, db *pgxpool.Pool) (int, string) {
	var backend int
	if err := db.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
		return 0, fmt.Sprintf("cannot read pg_backend_pid() (%v)", err)
	}
	if p, ok := procStat(backend); ok && p.comm == "postgres" {
		return p.ppid, ""
	}
	return 0, fmt.Sprintf("PostgreSQL is not on this machine (its backend pid %d is no postgres process in /proc)", backend)
}

// serverCPU is the CPU time of a PostgreSQL server's processes at one
// moment: each live one's by pid, and what the postmaster's exited
// children used (reaped).
type serverCPU struct {
	procs  map[int]time.Duration
	reaped time.Duration
}

// readServerCPU reads the CPU time of the postmaster and of every postgres
// process it started (backends, WAL writer, checkpointer, autovacuum…).
func readServerCPU(postmaster int) (serverCPU, bool) {
	pm, ok := procStat(postmaster)
	ents, err := os.ReadDir("/proc")
	if !ok || err != nil {
		return serverCPU{}, false
	}
	s := serverCPU{procs: map[int]time.Duration{postmaster: pm.cpu}, reaped: pm.reaped}
	for _, d := range ents {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if p, ok := procStat(pid); ok && p.ppid == postmaster && p.comm == "postgres" {
			s.procs[pid] = p.cpu
		}
	}
	return s, true
}

// serverCPUBetween is the CPU the server used between readings a and b:
// the growth of each process alive at b (all of it for one started in
// between), plus what processes that exited in between used after a. The
// latter's ticks are gone from /proc but for the postmaster's reaped total,
// so they count as that total's growth less what they had used at a. An
// approximation: one reaped while b scans /proc is missed, and a pid
// reused in between counts as one process; the pools are warm, so few
// processes come and go in a window.
func serverCPUBetween(a, b serverCPU) time.Duration {
	d := b.reaped - a.reaped
	for pid, t := range b.procs {
		d += max(0, t-a.procs[pid])
	}
	for pid, t := range a.procs {
		if _, ok := b.procs[pid]; !ok {
			d -= t
		}
	}
	return max(0, d)
}

// costCPU is this process's and the local PostgreSQL server's CPU time at
// one end of a cost window. Apart from cpuReading, as scanning /proc takes
// milliseconds, too long for end_to_end_latency's paced load.
type costCPU struct {
	self             time.Duration
	server           serverCPU
	selfOK, serverOK bool
}

func (e *env) readCostCPU() costCPU {
	var c costCPU
	c.self, c.selfOK = procCPU(os.Getpid())
	if e.postmaster > 0 {
		c.server, c.serverOK = readServerCPU(e.postmaster)
	}
	return c
}

// cpuReading is the machine's, this process's and the broker's CPU time
// at one moment.
type cpuReading struct {
	at                          time.Time
	machine                     cpuTimes
	self, broker                time.Duration
	machineOK, selfOK, brokerOK bool
}

// readCPUs reads them all; the broker's only when Config.BrokerPID is set
// and a real broker is used.
func (e *env) readCPUs() cpuReading {
	r := cpuReading{at: time.Now()}
	r.machine, r.machineOK = readCPU()
	r.self, r.selfOK = procCPU(os.Getpid())
	if e.cfg.BrokerPID > 0 && len(e.cfg.Brokers) > 0 {
		r.broker, r.brokerOK = procCPU(e.cfg.BrokerPID)
	}
	return r
}

// setCPU fills s's CPU figures from two readings around events measured
// events.
func (s *rateResult) setCPU(a, b cpuReading, events int) {
	window := b.at.Sub(a.at).Seconds()
	if a.at.IsZero() || window <= 0 {
		return
	}
	if a.machineOK && b.machineOK {
		s.cpu, s.cpuOK = cpuBetween(a.machine, b.machine), true
		if events > 0 {
			s.cpuPerEvent = 1000 * s.cpu.cores * window / float64(events)
		}
	}
	if a.selfOK && b.selfOK {
		s.proc, s.procOK = (b.self-a.self).Seconds()/window, true
	}
	if a.brokerOK && b.brokerOK {
		s.broker, s.brokerOK = (b.broker-a.broker).Seconds()/window, true
	}
}

// describeCPU is one progress line's CPU part.
func (e *env) describeCPU(s rateResult) string {
	out := fmt.Sprintf("machine CPU %.0f%% busy (%.2f cores, %.2f ms per event)", 100*s.cpu.busy, s.cpu.cores, s.cpuPerEvent)
	if s.procOK {
		out += fmt.Sprintf("; %s %.2f cores", e.pipelineProcess(), s.proc)
	}
	switch {
	case len(e.cfg.Brokers) == 0:
	case s.brokerOK:
		out += fmt.Sprintf("; broker (pid %d) %.2f cores", e.cfg.BrokerPID, s.broker)
	default:
		out += "; broker n/a"
	}
	return out
}

// pipelineProcess names what this process's CPU covers.
func (e *env) pipelineProcess() string {
	if len(e.cfg.Brokers) == 0 {
		return "bench process: pipelines and kfake"
	}
	return "bench process: pipelines"
}

// describeCPUCosts says what the cost table's CPU columns measure.
func (e *env) describeCPUCosts() string {
	self := "the whole process, so anything else it does then too"
	if len(e.cfg.Brokers) == 0 {
		self = "the whole process, so the in-process kfake broker and anything else it does then too"
	}
	out := "GO µs/EV = this process's CPU (user + system, /proc/self/stat) over the window ÷ events: " + self
	if e.postmaster == 0 {
		return out + `; PG µs/EV "-": ` + e.noServerCPU
	}
	return out + fmt.Sprintf("; PG µs/EV = the CPU (user + system, /proc/<pid>/stat) of the PostgreSQL server over the window ÷ events: postmaster %d and every postgres process it started (backends, WAL writer, checkpointer, autovacuum…: writing WAL and checkpoints are part of the cost), those that exited through its reaped children's total; the whole server's, so other sessions' too (another benchmark on the same server inflates it); both in %d ms ticks", e.postmaster, 1000/clockTicks)
}

// brokerCPUNote says whether the broker's CPU is known.
func (e *env) brokerCPUNote() string {
	switch {
	case len(e.cfg.Brokers) == 0:
		return "the broker is kfake, inside this process"
	case e.cfg.BrokerPID > 0:
		if _, ok := procCPU(e.cfg.BrokerPID); ok {
			return fmt.Sprintf("broker CPU from /proc/%d/stat (%s) over the same window", e.cfg.BrokerPID, BrokerPIDEnv)
		}
		return fmt.Sprintf("broker CPU n/a: /proc/%d/stat (%s) cannot be read", e.cfg.BrokerPID, BrokerPIDEnv)
	}
	return "broker CPU n/a: a real broker, its process id unknown (set " + BrokerPIDEnv + ")"
}
