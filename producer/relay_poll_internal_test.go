package producer

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestPollIntervalFollowsTheRelaysRate: while shards linger the poller
// polls about once per row the relay relays, between every 2 ms (from 500
// rows/s up) and every 10 ms (at 100 rows/s and below, or idle). Before,
// it polled every 2 ms at any rate: 2.8 polls per event at 100 events/s.
func TestPollIntervalFollowsTheRelaysRate(t *testing.T) {
	for _, c := range []struct {
		rate float64 // rows per second
		want time.Duration
	}{
		{0, maxHotPollInterval},
		{20, maxHotPollInterval},
		{100, maxHotPollInterval},
		{250, 4 * time.Millisecond},
		{500, hotPollInterval},
		{5000, hotPollInterval},
	} {
		p := newPoller(nil)
		p.rows, p.rowsAt = c.rate*rateWindow.Seconds(), time.Now()
		got := p.rateInterval()
		require.InDelta(t, float64(c.want), float64(got), float64(c.want)/50, "at %.0f rows/s", c.rate)
	}

	// The estimate follows the rows relayed: 200 rows/s for ten
	// seconds, in batches of two, ending now...
	p := newPoller(nil)
	now := time.Now()
	for ms := -10000; ms <= 0; ms += 10 {
		p.mu.Lock()
		p.decay(now.Add(time.Duration(ms) * time.Millisecond))
		p.rows += 2
		p.mu.Unlock()
	}
	require.InDelta(t, float64(5*time.Millisecond), float64(p.rateInterval()), float64(time.Millisecond)/5)
	// ... and decays once they stop.
	p.mu.Lock()
	p.rowsAt = p.rowsAt.Add(-3 * rateWindow)
	p.mu.Unlock()
	require.Equal(t, maxHotPollInterval, p.rateInterval())
}
