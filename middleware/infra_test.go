package middleware_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

// proxiedPool opens a pool on the test database through a fault proxy.
func proxiedPool(t *testing.T, maxConns int32) (*pgxpool.Pool, *faultproxy.Proxy) {
	t.Helper()
	proxy, err := faultproxy.Start(pgtest.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	cfg, err := pgxpool.ParseConfig(pgtest.URLVia(proxy.Addr()))
	require.NoError(t, err)
	cfg.MaxConns = maxConns
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, proxy
}

func TestIsInfrastructureOnRealFailures(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct := pgtest.Pool(t, 2)
	pool, proxy := proxiedPool(t, 2)

	// A healthy database: SQL errors are the statement's, not the
	// infrastructure's.
	_, err := pool.Exec(ctx, `SELECT 1/0`)
	require.False(t, middleware.IsInfrastructure(err), "%v", err)
	require.True(t, middleware.IsPermanent(err), "division by zero (class 22) never succeeds: %v", err)
	_, err = pool.Exec(ctx, `SELECT $1::text`, "nul\x00byte")
	require.True(t, middleware.IsPermanent(err), "a NUL byte in text is the data's fault: %v", err)
	tmp := "t_" + randomHex()
	_, err = direct.Exec(ctx, `CREATE TABLE `+tmp+` (k text PRIMARY KEY)`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = direct.Exec(context.Background(), `DROP TABLE `+tmp) })
	_, err = pool.Exec(ctx, `INSERT INTO `+tmp+` VALUES ('a'), ('a')`)
	require.False(t, middleware.IsInfrastructure(err), "a unique violation is the handler's: %v", err)
	require.False(t, middleware.IsPermanent(err))
	big := randomText(1 << 20)
	_, err = pool.Exec(ctx, `INSERT INTO `+tmp+` VALUES ($1)`, big)
	require.True(t, middleware.IsPermanent(err), "a key too large for its index (class 54) never fits: %v", err)
	// A value pgx refuses to encode for its parameter, before PostgreSQL
	// sees it: wrapped by the handler, or joined, it stays permanent.
	_, err = pool.Exec(ctx, `SELECT $1::int4`, int64(1)<<40)
	require.ErrorContains(t, err, "int4")
	require.True(t, middleware.IsPermanent(fmt.Errorf("insert amount: %w", err)), "a number beyond int4 never fits: %v", err)
	require.True(t, middleware.IsPermanent(errors.Join(errors.New("other"), err)))
	require.False(t, middleware.IsInfrastructure(err))

	// The server ends the session (as at a shutdown): FATAL 57P01.
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	var pid int
	require.NoError(t, conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	_, err = direct.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `SELECT 1`)
	require.Error(t, err)
	require.True(t, middleware.IsInfrastructure(err), "a terminated session: %v", err)
	conn.Release()

	// Connections dropped, then refused.
	conn, err = pool.Acquire(ctx)
	require.NoError(t, err)
	proxy.Set(faultproxy.Refuse)
	proxy.Drop()
	_, err = conn.Exec(ctx, `SELECT 1`)
	require.True(t, middleware.IsInfrastructure(err), "a dropped connection: %v", err)
	conn.Release()
	_, err = pool.Exec(ctx, `SELECT 1`)
	require.True(t, middleware.IsInfrastructure(err), "a refused connection: %v", err)

	// A frozen connection: only a deadline ends the wait.
	proxy.Set(faultproxy.Pass)
	conn, err = pool.Acquire(ctx)
	require.NoError(t, err)
	proxy.Set(faultproxy.Freeze)
	fctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = conn.Exec(fctx, `SELECT 1`)
	cancel()
	require.True(t, middleware.IsInfrastructure(err), "a frozen connection's timeout: %v", err)
	conn.Release()
	proxy.Set(faultproxy.Pass)

	// Classification by SQLSTATE.
	for code, infra := range map[string]bool{"08006": true, "08001": true, "57P01": true, "57P02": true, "57P03": true,
		"53300": true, "53100": true, "58030": true, "57014": false, "23505": false, "40001": false, "42P01": false, "XX000": false} {
		require.Equal(t, infra, middleware.IsInfrastructure(fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: code})), code)
	}
	require.True(t, middleware.IsConflict(&pgconn.PgError{Code: "40P01"}))
	require.False(t, middleware.IsInfrastructure(nil))
	require.False(t, middleware.IsInfrastructure(errors.New("smtp down")))
	require.False(t, middleware.IsInfrastructure(middleware.Permanent(netErr(errors.New("x")))))
}

// netErr wraps err as an I/O error of the network.
func netErr(err error) error { return &net.OpError{Op: "read", Net: "tcp", Err: err} }

func randomHex() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// randomText returns n bytes of incompressible printable text.
func randomText(n int) string {
	b := make([]byte, n/2)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// The eventline middleware judges failures that look alike by whether the
// consumer's database still answers.
func TestEventlineClassifiesFailuresByWhetherTheDatabaseAnswers(t *testing.T) {
	t.Parallel()
	env := consumertest.New(t, pgtest.Options{MaxConns: 2})
	pool, proxy := proxiedPool(t, 3)
	el, err := middleware.New(pool, middleware.Config{Schema: env.Schema, Group: group, Logger: quiet(), TxTimeout: time.Second})
	require.NoError(t, err)
	var step func(ctx context.Context, tx pgx.Tx) error
	h := el.MiddlewareFor("test")(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := middleware.TxFromContext(msg.Context())
		e, _ := middleware.EventFromContext(msg.Context())
		if err := env.Apply(msg.Context(), tx, group, e); err != nil {
			return nil, err
		}
		return nil, step(msg.Context(), tx)
	})
	v := int64(0)
	deliver := func() error {
		v++
		_, err := h(consumertest.Message(t, consumertest.Event("a", v)))
		return err
	}

	// The handler's own network call fails; the database is fine.
	step = func(ctx context.Context, _ pgx.Tx) error {
		_, err := (&net.Dialer{}).DialContext(ctx, "tcp", "127.0.0.1:1")
		return err
	}
	err = deliver()
	require.Error(t, err)
	require.False(t, middleware.IsInfrastructure(err), "the handler's own network error counts against its budget: %v", err)

	// The handler's own deadline ends its slow query; the database answers.
	step = func(ctx context.Context, tx pgx.Tx) error {
		qctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		_, err := tx.Exec(qctx, `SELECT pg_sleep(5)`)
		return err
	}
	v--
	err = deliver()
	require.Error(t, err)
	require.False(t, middleware.IsInfrastructure(err), "the handler's own timeout: %v", err)

	// The handler is slower than TxTimeout; the database answers.
	step = func(ctx context.Context, _ pgx.Tx) error {
		<-ctx.Done()
		return ctx.Err()
	}
	v--
	err = deliver()
	require.Error(t, err)
	require.False(t, middleware.IsInfrastructure(err), "a handler slower than TxTimeout: %v", err)
	require.ErrorContains(t, err, "TxTimeout")

	// The database freezes under the handler: TxTimeout notices, the
	// probe gets no answer either.
	step = func(ctx context.Context, tx pgx.Tx) error {
		proxy.Set(faultproxy.Freeze)
		_, err := tx.Exec(ctx, `SELECT 1`)
		return err
	}
	v--
	err = deliver()
	proxy.Set(faultproxy.Pass)
	require.Error(t, err)
	require.True(t, middleware.IsInfrastructure(err), "a frozen database: %v", err)
	_, ok := middleware.InfraOp(err)
	require.True(t, ok)

	// The connection dies before COMMIT: the outcome is unknown.
	step = func(context.Context, pgx.Tx) error {
		proxy.Drop()
		return nil
	}
	v--
	err = deliver()
	require.Error(t, err)
	require.True(t, middleware.IsInfrastructure(err), "a commit on a dead connection: %v", err)
	op, _ := middleware.InfraOp(err)
	require.Equal(t, "commit", op)

	// Nothing of the failed attempts was recorded; the next attempt works.
	step = func(context.Context, pgx.Tx) error { return nil }
	v--
	require.NoError(t, deliver())
	require.Len(t, env.Effects(t, group), 1)
}
