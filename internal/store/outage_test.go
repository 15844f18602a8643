package store_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
)

// An outage of the consumer's database longer than the park timeout must
// not make the first sweep after it give up on a gap: the missing version
// may still be waiting on Kafka behind the backlog the outage left. The
// timeout counts again from the end of the outage; it still expires after
// that. Before: the first successful pass skipped v2 at once.
func TestOutageLongerThanTheParkTimeoutSkipsNothing(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	require.Equal(t, store.Next, deliver(t, s, env, "a", 1))
	require.Equal(t, store.Gap, deliver(t, s, env, "a", 3))

	proxy, err := faultproxy.Start(pgtest.Addr())
	require.NoError(t, err)
	defer proxy.Close()
	cfg, err := pgxpool.ParseConfig(pgtest.URLVia(proxy.Addr()))
	require.NoError(t, err)
	cfg.ConnConfig.ConnectTimeout = time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()

	const parkTimeout = 1500 * time.Millisecond
	var mu sync.Mutex
	var passes []error
	a := &applied{}
	scfg := sweeper("g", parkTimeout, release(a.apply, 0))
	scfg.Interval, scfg.TxTimeout = 50*time.Millisecond, time.Second
	scfg.OnSweep = func(_ store.SweepResult, err error) {
		mu.Lock()
		passes = append(passes, err)
		mu.Unlock()
	}
	w := s.NewSweeper(pool, scfg)
	skipped := func() int {
		return pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(env.Schema, "skipped_versions"))
	}
	// waitPass waits for the next pass after the ones seen so far and
	// returns its error.
	waitPass := func() error {
		mu.Lock()
		seen := len(passes)
		mu.Unlock()
		var err error
		require.Eventually(t, func() bool {
			mu.Lock()
			defer mu.Unlock()
			if len(passes) > seen {
				err = passes[len(passes)-1]
				return true
			}
			return false
		}, 20*time.Second, 10*time.Millisecond)
		return err
	}

	// The outage starts before the sweeper does and lasts longer than the
	// park timeout.
	proxy.Set(faultproxy.Refuse)
	proxy.Drop()
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(runCtx) }()
	defer func() { stop(); <-done }()
	require.Error(t, waitPass(), "the database is unreachable")
	time.Sleep(parkTimeout) // the fault itself: the outage outlasts the park timeout
	require.Error(t, waitPass())

	proxy.Set(faultproxy.Pass)
	for i := 0; waitPass() != nil; i++ {
		require.Less(t, i, 200, "the sweeper never got through after the outage")
	}
	require.NoError(t, waitPass(), "a second healthy pass")
	require.Zero(t, skipped(), "the first passes after the outage give up on nothing")
	require.Zero(t, a.count("a"))

	// A whole park timeout of health later, the gap does expire.
	require.Eventually(t, func() bool { return skipped() == 1 }, 20*time.Second, 20*time.Millisecond)
	require.Equal(t, 1, a.count("a"), "v3 applied once after the skip")
}
