package producer_test

import (
	"context"
	"net"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/producer"
)

// countingConn counts the writes to a database connection: with pgx, one
// per round trip.
type countingConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c countingConn) Write(b []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(b)
}

// TestPublishTxIsOneRoundTrip: however many events a call writes, of
// however many aggregates, with or without supplied versions, PublishTx
// sends one message to PostgreSQL and waits once (once pgx has prepared
// the statement on the connection).
func TestPublishTxIsOneRoundTrip(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	var writes atomic.Int64
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.MaxConns = 1
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		return countingConn{Conn: conn, writes: &writes}, err
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	ctx := context.Background()
	p, err := producer.New(ctx, pool, producer.Config{Schema: env.Schema, DefaultTopic: "orders"})
	require.NoError(t, err)

	seq := 0
	next := func(id string) eventline.Event { seq++; return orderEvent(t, id+"-"+strconv.Itoa(seq%3)) }
	calls := map[string]func() []eventline.Event{
		"one event": func() []eventline.Event { return []eventline.Event{next("one")} },
		"100 events of 10 aggregates": func() []eventline.Event {
			var events []eventline.Event
			for i := range 100 {
				events = append(events, orderEvent(t, "many-"+strconv.Itoa(i%10)))
			}
			return events
		},
		"supplied versions": func() []eventline.Event {
			id := "sup-" + strconv.Itoa(seq)
			seq++
			return []eventline.Event{versioned(t, id, 1), orderEvent(t, id), orderEvent(t, "other")}
		},
	}
	for name, call := range calls {
		for round := range 3 {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			before := writes.Load()
			require.NoError(t, p.PublishTx(ctx, tx, call()...), name)
			n := writes.Load() - before
			require.NoError(t, tx.Commit(ctx))
			if round > 0 { // the first call prepares the statement
				require.EqualValues(t, 1, n, "%s: round trips", name)
			}
		}
	}
}
