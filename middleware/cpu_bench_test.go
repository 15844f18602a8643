package middleware_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// benchAppName names the benchmark pools' connections, so cpuMeter finds
// their server processes.
var benchAppName = func() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return "eventline-bench-" + hex.EncodeToString(b[:])
}()

// cpuMeter reports CPU time per event of the benchmark process (go-µs/ev)
// and of the PostgreSQL backends serving pool (pg-µs/ev, when PostgreSQL
// runs on this host): on a shared machine, CPU per event varies much less
// with the load than events per second.
func cpuMeter(b *testing.B, pool *pgxpool.Pool) func(events int64) {
	pg0, self0 := backendTicks(pool), selfCPU()
	return func(events int64) {
		if events == 0 {
			return
		}
		var ticks int64
		for pid, t := range backendTicks(pool) {
			ticks += t - pg0[pid]
		}
		b.ReportMetric(float64(ticks)*1e6/clockTicks/float64(events), "pg-µs/ev")
		b.ReportMetric(float64(selfCPU()-self0)/1e3/float64(events), "go-µs/ev")
	}
}

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat times (100 on Linux).
const clockTicks = 100

// backendTicks returns the CPU time, in clock ticks, of each server process
// with the benchmark's application name.
func backendTicks(pool *pgxpool.Pool) map[int]int64 {
	rows, err := pool.Query(context.Background(), `SELECT pid FROM pg_stat_activity WHERE application_name = $1`, benchAppName)
	if err != nil {
		return nil
	}
	defer rows.Close()
	out := map[int]int64{}
	for rows.Next() {
		var pid int
		if rows.Scan(&pid) == nil {
			out[pid] = procTicks(pid)
		}
	}
	return out
}

func procTicks(pid int) int64 {
	st, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	s := string(st)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	k, _ := strconv.ParseInt(f[12], 10, 64)
	return u + k
}

func selfCPU() int64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}
