package producer_test

import (
	"context"
	"net"
	"strconv"
	"strings"
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

// countingPool is a one-connection pool whose writes are counted, and its
// config.
func countingPool(t *testing.T) (*pgxpool.Pool, *pgxpool.Config, *atomic.Int64) {
	t.Helper()
	writes := &atomic.Int64{}
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.MaxConns = 1
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		return countingConn{Conn: conn, writes: writes}, err
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, cfg, writes
}

// TestPublishTxIsOneRoundTrip: however many events a call writes, of
// however many aggregates, with or without supplied versions, PublishTx
// sends one message to PostgreSQL and waits once (once pgx has prepared
// the statement on the connection). Events whose versions are the
// caller's (Config.CallerVersionedTypes) are one statement too, and two
// when the call mixes them with others.
func TestPublishTxIsOneRoundTrip(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	pool, _, writes := countingPool(t)
	ctx := context.Background()

	trusting, err := producer.New(ctx, pool, producer.Config{Schema: env.Schema, DefaultTopic: "orders", CallerVersionedTypes: []string{"invoice"}})
	require.NoError(t, err)
	invoices := 0

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
		"the caller's versions, mixed with assigned ones (two statements)": func() []eventline.Event {
			invoices++
			return []eventline.Event{{Type: "invoice.sent", AggregateType: "invoice", AggregateID: "inv", AggregateVersion: int64(invoices), Payload: []byte(`{}`)},
				orderEvent(t, "mixed")}
		},
	}
	for name, call := range calls {
		for round := range 3 {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			before := writes.Load()
			require.NoError(t, trusting.PublishTx(ctx, tx, call()...), name)
			n := writes.Load() - before
			require.NoError(t, tx.Commit(ctx))
			want := int64(1)
			if strings.Contains(name, "two statements") {
				want = 2
			}
			if round > 0 { // the first call prepares the statement
				require.EqualValues(t, want, n, "%s: round trips", name)
			}
		}
	}
}
