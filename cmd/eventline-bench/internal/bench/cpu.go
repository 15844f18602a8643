package bench

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
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

// procCPU returns the CPU time (user + system) process pid has used, from
// /proc/<pid>/stat; ok is false where there is none.
func procCPU(pid int) (time.Duration, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	// The command name, in parentheses, may hold spaces: fields count
	// from after its closing parenthesis (state is field 3; utime 14,
	// stime 15).
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, false
	}
	utime, err1 := strconv.ParseUint(f[11], 10, 64)
	stime, err2 := strconv.ParseUint(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(utime+stime) * time.Second / clockTicks, true
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
