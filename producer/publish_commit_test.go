package producer_test

import (
	"context"
	"errors"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// ordersTable creates the business table the PublishAndCommit tests write.
func ordersTable(t *testing.T, env pgtest.Env) string {
	t.Helper()
	table := sqlident.Qualify(env.Schema, "orders")
	_, err := env.Pool.Exec(context.Background(), `CREATE TABLE `+table+` (id text PRIMARY KEY)`)
	require.NoError(t, err)
	return table
}

// insertOrder is a business transaction's work: one order row, and its
// order.created event(s).
func insertOrder(t *testing.T, table, id string, events ...eventline.Event) func(pgx.Tx) ([]eventline.Event, error) {
	return func(tx pgx.Tx) ([]eventline.Event, error) {
		if _, err := tx.Exec(context.Background(), `INSERT INTO `+table+` (id) VALUES ($1)`, id); err != nil {
			return nil, err
		}
		return events, nil
	}
}

// TestPublishAndCommitSendsTheOutboxStatementWithTheCommit: a business
// transaction of one statement costs three round trips with
// PublishAndCommit (BEGIN, the statement, the outbox statement with
// COMMIT) where PublishTx and Commit cost four; on a pool and on a
// connection, for one event or many, and for events whose versions are the
// caller's (Config.CallerVersionedTypes). Events with supplied versions
// otherwise take PublishTx's path: four.
func TestPublishAndCommitSendsTheOutboxStatementWithTheCommit(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1}) // one statement per shard (set), prepared by round 0
	table := ordersTable(t, env)
	pool, cfg, writes := countingPool(t)
	ctx := context.Background()
	p, err := producer.New(ctx, pool, producer.Config{Schema: env.Schema, DefaultTopic: "orders"})
	require.NoError(t, err)
	connCfg := cfg.ConnConfig.Copy()
	conn, err := pgx.ConnectConfig(ctx, connCfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(ctx) })

	trusting, err := producer.New(ctx, pool, producer.Config{Schema: env.Schema, DefaultTopic: "orders", CallerVersionedTypes: []string{"order"}})
	require.NoError(t, err)

	seq := 0
	id := func() string { seq++; return "o-" + strconv.Itoa(seq) }
	for name, c := range map[string]struct {
		p  *producer.Producer
		db interface {
			Begin(context.Context) (pgx.Tx, error)
		}
		events func(id string) []eventline.Event
		want   int64
	}{
		"pool, one event": {p, pool, func(id string) []eventline.Event { return []eventline.Event{orderEvent(t, id)} }, 3},
		"conn, one event": {p, conn, func(id string) []eventline.Event { return []eventline.Event{orderEvent(t, id)} }, 3},
		"pool, 3 events of 2 aggregates": {p, pool, func(id string) []eventline.Event {
			return []eventline.Event{orderEvent(t, id), orderEvent(t, id+"-b"), orderEvent(t, id)}
		}, 3},
		"pool, supplied version": {p, pool, func(id string) []eventline.Event { return []eventline.Event{versioned(t, id, 1)} }, 4},
		"pool, the caller's versions": {trusting, pool, func(id string) []eventline.Event {
			return []eventline.Event{versioned(t, id, 1), versioned(t, id, 2), versioned(t, id+"-b", 1)}
		}, 3},
	} {
		for round := range 3 {
			before := writes.Load()
			oid := id()
			written, err := c.p.PublishAndCommit(ctx, c.db, insertOrder(t, table, oid, c.events(oid)...))
			require.NoError(t, err, name)
			n := writes.Load() - before
			require.Equal(t, oid, written[0].AggregateID)
			require.EqualValues(t, 1, written[0].AggregateVersion)
			if round > 0 && c.db == pool { // the first call prepares the statements; conn's writes are not counted
				require.EqualValues(t, c.want, n, "%s: round trips", name)
			}
		}
	}
	require.Equal(t, 15, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+table))
	require.Equal(t, 3+3+3*3+3+3*3, outboxCount(t, env))
	require.EqualValues(t, 1, pool.Stat().IdleConns(), "the connection went back to the pool")
}

// TestPublishAndCommitCommitsOrRollsBackEverything: the business rows and
// the events commit together or not at all, whatever fails: fn, an event,
// a topic or version conflict. A conflict rolls the whole transaction back
// (unlike PublishTx, which leaves it usable). fn cannot end the
// transaction itself.
func TestPublishAndCommitCommitsOrRollsBackEverything(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	table := ordersTable(t, env)
	p := newProducer(t, env)
	ctx := context.Background()
	orders := func() int { return pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+table) }

	written, err := p.PublishAndCommit(ctx, env.Pool, insertOrder(t, table, "a", orderEvent(t, "a"), orderEvent(t, "a")))
	require.NoError(t, err)
	require.EqualValues(t, []int64{1, 2}, []int64{written[0].AggregateVersion, written[1].AggregateVersion})
	require.EqualValues(t, []int64{0, 1}, []int64{written[0].PreviousVersion, written[1].PreviousVersion})
	require.Equal(t, []int64{1, 2}, versionsOf(t, env, "a"))
	require.Equal(t, 1, orders())

	// No events: the business rows alone.
	written, err = p.PublishAndCommit(ctx, env.Pool, insertOrder(t, table, "b"))
	require.NoError(t, err)
	require.Empty(t, written)
	require.Equal(t, 2, orders())

	boom := errors.New("boom")
	for name, c := range map[string]struct {
		fn    func(pgx.Tx) ([]eventline.Event, error)
		check func(error)
	}{
		"fn fails": {func(tx pgx.Tx) ([]eventline.Event, error) {
			_, _ = insertOrder(t, table, "c")(tx)
			return []eventline.Event{orderEvent(t, "c")}, boom
		}, func(err error) { require.ErrorIs(t, err, boom) }},
		"an invalid event": {insertOrder(t, table, "c", eventline.Event{Type: "x", AggregateType: "order", Payload: []byte(`{}`)}),
			func(err error) { require.ErrorIs(t, err, eventline.ErrInvalidEvent) }},
		"another topic, one event": {insertOrder(t, table, "c", onTopic(orderEvent(t, "a"), "billing")), func(err error) {
			var tc *producer.TopicConflictError
			require.ErrorAs(t, err, &tc)
			require.Equal(t, producer.TopicConflictError{AggregateType: "order", AggregateID: "a", Topic: "orders", Requested: "billing"}, *tc)
		}},
		"another topic, among events": {insertOrder(t, table, "c", orderEvent(t, "c"), onTopic(orderEvent(t, "a"), "billing")), func(err error) {
			require.ErrorIs(t, err, producer.ErrTopicConflict)
			require.ErrorContains(t, err, "event 1:")
		}},
		"a stale supplied version": {insertOrder(t, table, "c", versioned(t, "a", 2)), func(err error) {
			require.ErrorIs(t, err, producer.ErrVersionConflict)
		}},
		"fn commits": {func(tx pgx.Tx) ([]eventline.Event, error) {
			_, _ = insertOrder(t, table, "c")(tx)
			return nil, tx.Commit(ctx)
		}, func(err error) {
			require.ErrorContains(t, err, "PublishAndCommit commits or rolls back the transaction itself")
		}},
	} {
		_, err := p.PublishAndCommit(ctx, env.Pool, c.fn)
		require.Error(t, err, name)
		c.check(err)
		require.Equal(t, 2, orders(), "%s: the order was rolled back", name)
		require.Equal(t, []int64{1, 2}, versionsOf(t, env, "a"), name)
		_, _, ok := sequence(t, env, "order", "c")
		require.False(t, ok, "%s: the sequence was rolled back", name)
	}
	require.Equal(t, 2, outboxCount(t, env))

	// Aggregates whose sequence row predates topics get theirs recorded.
	_, err = env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "aggregate_sequences")+
		` (aggregate_type, aggregate_id, version) VALUES ('order', 'old', 4), ('order', 'older', 7)`)
	require.NoError(t, err)
	written, err = p.PublishAndCommit(ctx, env.Pool, insertOrder(t, table, "d", orderEvent(t, "old")))
	require.NoError(t, err)
	require.EqualValues(t, 5, written[0].AggregateVersion)
	_, err = p.PublishAndCommit(ctx, env.Pool, insertOrder(t, table, "e", orderEvent(t, "older"), orderEvent(t, "e")))
	require.NoError(t, err)
	for id, want := range map[string]int64{"old": 5, "older": 8, "e": 1} {
		v, topic, ok := sequence(t, env, "order", id)
		require.True(t, ok, id)
		require.Equal(t, want, v, id)
		require.NotNil(t, topic, id)
		require.Equal(t, "orders", *topic, id)
	}
	require.Zero(t, env.Pool.Stat().AcquiredConns(), "a connection was left acquired")
}

// TestPublishAndCommitWritesWhatPublishTxWrites: the same events written
// by PublishAndCommit and by PublishTx are the same outbox rows, byte for
// byte (but the row's own uuid).
func TestPublishAndCommitWritesWhatPublishTxWrites(t *testing.T) {
	t.Parallel()
	envA := pgtest.New(t, pgtest.Options{Shards: 2})
	envB := pgtest.New(t, pgtest.Options{Shards: 2})
	ctx := context.Background()
	at := time.Date(2024, 2, 29, 23, 59, 58, 123456789, time.UTC)
	events := func() []eventline.Event {
		var out []eventline.Event
		for i, id := range []string{"x", "y", "x"} {
			e := orderEvent(t, id)
			e.ID, e.OccurredAt, e.CorrelationID = "00000000-0000-7000-8000-00000000000"+strconv.Itoa(i), at, "c"
			e.Metadata = map[string]string{"tenant": "ü <b>&</b>"}
			out = append(out, e)
		}
		return out
	}
	for _, n := range []int{1, 3} {
		a, b := newProducer(t, envA), newProducer(t, envB)
		_, err := a.PublishAndCommit(ctx, envA.Pool, func(pgx.Tx) ([]eventline.Event, error) { return events()[:n], nil })
		require.NoError(t, err)
		require.NoError(t, b.Publish(ctx, envB.Pool, events()[:n]...))
		for _, e := range events()[:n] {
			rowsA, rowsB := rowsOf(t, envA, e.ID), rowsOf(t, envB, e.ID)
			require.Equal(t, len(rowsB), len(rowsA))
			for i := range rowsA {
				require.Equal(t, rowsB[i].payload, rowsA[i].payload)
				require.Equal(t, rowsB[i].metadata, rowsA[i].metadata)
			}
		}
	}
}

// TestPublishAndCommitAssignsEachVersionOnce: concurrent calls on a few
// aggregates get consecutive versions, each once, as with PublishTx.
func TestPublishAndCommitAssignsEachVersionOnce(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 8})
	p := newProducer(t, env)
	ctx := context.Background()
	aggs := []string{"a", "b", "c"}
	errs := make(chan error, 8)
	for w := range 8 {
		go func() {
			var err error
			for i := range 25 {
				evs := []eventline.Event{orderEvent(t, aggs[(w+i)%3])}
				if i%5 == 0 { // and calls of two aggregates
					evs = append(evs, orderEvent(t, aggs[(w+i+1)%3]), orderEvent(t, aggs[(w+i)%3]))
				}
				if _, err = p.PublishAndCommit(ctx, env.Pool, func(pgx.Tx) ([]eventline.Event, error) { return evs, nil }); err != nil {
					break
				}
			}
			errs <- err
		}()
	}
	for range 8 {
		require.NoError(t, <-errs)
	}
	total := 0
	for _, id := range aggs {
		vs := versionsOf(t, env, id)
		slices.Sort(vs)
		for i, v := range vs {
			require.EqualValues(t, i+1, v, "aggregate %s: versions %v", id, vs)
		}
		last, _, _ := sequence(t, env, "order", id)
		require.EqualValues(t, len(vs), last)
		total += len(vs)
	}
	require.Equal(t, 8*25+8*5*2, total)
}

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
