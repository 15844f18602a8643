package bench

import (
	"os"
	"runtime"
	"strconv"
	"strings"
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
