package middleware_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

// roundTrips counts what a pool sends to the server: each query outside a
// batch and each batch is one round trip.
type roundTrips struct{ n atomic.Int64 }

func (r *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	r.n.Add(1)
	return ctx
}
func (r *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (r *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.n.Add(1)
	return ctx
}
func (r *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (r *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// The hot path stays at three round trips per event (BEGIN and the
// admission in one batch, the handler's statement, COMMIT), and telling an
// id conflict from a duplicate costs none: the admission statement returns
// the recorded event's identity.
func TestHotPathRoundTrips(t *testing.T) {
	t.Parallel()
	env := consumertest.New(t, pgtest.Options{MaxConns: 2})
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	rt := &roundTrips{}
	cfg.ConnConfig.Tracer = rt
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, pool.Ping(context.Background()))

	el, err := middleware.New(pool, middleware.Config{Schema: env.Schema, Group: group, Logger: quiet()})
	require.NoError(t, err)
	h := el.MiddlewareFor("test")(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := middleware.TxFromContext(msg.Context())
		e, _ := middleware.EventFromContext(msg.Context())
		return nil, env.Apply(msg.Context(), tx, group, e) // two statements
	})
	cost := func(e *message.Message) (int64, error) {
		before := rt.n.Load()
		_, err := h(consumertest.Redeliver(e))
		return rt.n.Load() - before, err
	}
	first := consumertest.Event("a", 1)
	n, err := cost(consumertest.Message(t, first))
	require.NoError(t, err)
	require.EqualValues(t, 1+2+1, n, "batch(BEGIN, admit) + the handler's 2 statements + COMMIT")
	n, err = cost(consumertest.Message(t, first))
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "a duplicate: batch + COMMIT")
	clash := consumertest.Event("a", 2)
	clash.ID = first.ID
	n, err = cost(consumertest.Message(t, clash))
	require.ErrorIs(t, err, dedup.ErrIDConflict)
	require.EqualValues(t, 2, n, "an id conflict: batch + ROLLBACK, no extra query")
}
