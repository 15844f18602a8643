package faultproxy_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/pgtest"
)

func connect(t *testing.T, p *faultproxy.Proxy, timeout time.Duration) (*pgx.Conn, error) {
	t.Helper()
	cfg, err := pgx.ParseConfig(pgtest.URLVia(p.Addr()))
	require.NoError(t, err)
	cfg.ConnectTimeout = timeout
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return pgx.ConnectConfig(ctx, cfg)
}

func TestProxyModes(t *testing.T) {
	p, err := faultproxy.Start(pgtest.Addr())
	require.NoError(t, err)
	defer p.Close()

	conn, err := connect(t, p, 5*time.Second)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, conn.Ping(ctx))

	// Frozen: the open connection stays open but nothing answers.
	p.Set(faultproxy.Freeze)
	fctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err = conn.Ping(fctx)
	cancel()
	require.Error(t, err, "a frozen connection must not answer")
	p.Set(faultproxy.Pass)
	conn.Close(ctx)

	// Refused: new connections fail at once.
	// The count may already include a connection pgx opened on its own: the
	// cancel request it sends when the frozen Ping's context ended arrives
	// whenever it does, so compare with the count before this attempt.
	p.Set(faultproxy.Refuse)
	before := p.Refused()
	_, err = connect(t, p, 2*time.Second)
	require.Error(t, err)
	require.Greater(t, p.Refused(), before, "the refused attempt is counted")
	p.Set(faultproxy.Pass)

	// Dropped: open connections break; new ones work.
	conn, err = connect(t, p, 5*time.Second)
	require.NoError(t, err)
	p.Drop()
	require.Error(t, conn.Ping(ctx))
	conn, err = connect(t, p, 5*time.Second)
	require.NoError(t, err)
	require.NoError(t, conn.Ping(ctx))
	conn.Close(ctx)
}
