package store_test

import (
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/versioning"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newStore(t *testing.T) (*store.Store, pgtest.Env) {
	t.Helper()
	env := pgtest.New(t, pgtest.Options{MaxConns: 4})
	s, err := store.New(env.Schema)
	require.NoError(t, err)
	return s, env
}

// release is the release options the middleware gives the store by
// default, with apply (and backoff's first wait, when set).
func release(apply store.ApplyFunc, backoff time.Duration) store.ReleaseOptions {
	b := versioning.DefaultReleaseBackoff
	if backoff > 0 {
		b.Initial = backoff
	}
	return store.ReleaseOptions{Apply: apply, MaxAttempts: versioning.DefaultMaxReleaseAttempts, Backoff: b}
}

// sweeper is the configuration the middleware gives a sweeper by default
// for group, with the park timeout and release options given.
func sweeper(group string, parkTimeout time.Duration, r store.ReleaseOptions) store.SweeperConfig {
	return store.SweeperConfig{Group: group, ParkTimeout: parkTimeout, Interval: versioning.DefaultSweepInterval,
		TxTimeout: time.Minute, Batch: versioning.DefaultSweepBatch, Release: r,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
}
