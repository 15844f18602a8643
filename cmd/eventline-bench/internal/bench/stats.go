package bench

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
)

// latencies collects durations from many goroutines.
type latencies struct {
	mu sync.Mutex
	d  []time.Duration
}

func (l *latencies) add(d time.Duration) {
	l.mu.Lock()
	l.d = append(l.d, d)
	l.mu.Unlock()
}

func (l *latencies) summary() summary {
	l.mu.Lock()
	d := slices.Clone(l.d)
	l.mu.Unlock()
	return summarize(d)
}

// summary describes a latency distribution.
type summary struct {
	n                        int
	mean, p50, p95, p99, max time.Duration
}

func summarize(d []time.Duration) summary {
	if len(d) == 0 {
		return summary{}
	}
	slices.Sort(d)
	var sum time.Duration
	for _, x := range d {
		sum += x
	}
	return summary{
		n: len(d), mean: sum / time.Duration(len(d)),
		p50: quantile(d, 0.50), p95: quantile(d, 0.95), p99: quantile(d, 0.99), max: d[len(d)-1],
	}
}

// quantile returns the q-quantile of sorted d (nearest rank).
func quantile(d []time.Duration, q float64) time.Duration {
	i := int(float64(len(d))*q+0.5) - 1
	return d[min(max(i, 0), len(d)-1)]
}

func (s summary) String() string {
	return fmt.Sprintf("n=%d mean=%s p50=%s p95=%s p99=%s max=%s", s.n, ms(s.mean), ms(s.p50), ms(s.p95), ms(s.p99), ms(s.max))
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond)) }

// millis converts to float milliseconds for the table.
func millis(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func firstWord(s string) string {
	s = strings.TrimSpace(s)
	for strings.HasPrefix(s, "--") || strings.HasPrefix(s, "(") {
		if strings.HasPrefix(s, "(") {
			s = strings.TrimSpace(s[1:])
			continue
		}
		i := strings.IndexByte(s, '\n')
		if i < 0 {
			return "comment"
		}
		s = strings.TrimSpace(s[i+1:])
	}
	if i := strings.IndexAny(s, " \t\n("); i >= 0 {
		return s[:i]
	}
	return s
}
