package producer_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/producer"
)

// TestPublishTxMirroredCallsNeverDeadlock runs, many times over, two
// transactions that publish to the same two aggregates with mirrored mixes:
// one supplies A's version and lets B's be assigned, the other the
// reverse. Every aggregate row must be locked in one ordered pass, so
// neither ever fails with a deadlock (SQLSTATE 40P01).
func TestPublishTxMirroredCallsNeverDeadlock(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 4})
	// Gaps allowed, so every supplied version (from a shared, steeply
	// rising counter) is above the last one whatever order the two
	// commit in: the only possible failure is the locking.
	p := newProducerWith(t, env, producer.Config{AllowVersionGaps: true})
	ctx := context.Background()
	var counter atomic.Int64
	counter.Store(1000)
	supplied := func(id string) eventline.Event { return versioned(t, id, counter.Add(10)) }

	const rounds = 150
	for round := 0; round < rounds; round++ {
		var start, wg sync.WaitGroup
		start.Add(2)
		errs := make([]error, 2)
		calls := [2]func() []eventline.Event{
			func() []eventline.Event { return []eventline.Event{supplied("A"), orderEvent(t, "B")} },
			func() []eventline.Event { return []eventline.Event{orderEvent(t, "A"), supplied("B")} },
		}
		for w := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[w] = pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
					start.Done()
					start.Wait() // both transactions are open before either publishes
					if err := p.PublishTx(ctx, tx, calls[w]()...); err != nil {
						return err
					}
					time.Sleep(time.Millisecond) // hold the locks a little
					return nil
				})
			}()
		}
		wg.Wait()
		for _, err := range errs {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) {
				require.NotEqual(t, "40P01", pgErr.Code, "round %d: deadlock: %v", round, err)
			}
			require.NoError(t, err, "round %d", round)
		}
	}
	a, _, _ := sequence(t, env, "order", "A")
	require.Greater(t, a, int64(1000))
	require.Len(t, versionsOf(t, env, "A"), 2*rounds)
	require.Len(t, versionsOf(t, env, "B"), 2*rounds)
}

// TestPublishTxRefusesVersionGapWithoutOptIn: a supplied version must be
// exactly the next one; a jump fails with a typed error, writes nothing and
// leaves the transaction usable.
func TestPublishTxRefusesVersionGapWithoutOptIn(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	ctx := context.Background()
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "a"))) // version 1

	tx := mustTx(t, env)
	err := p.PublishTx(ctx, tx, orderEvent(t, "other"), versioned(t, "a", 10))
	require.ErrorIs(t, err, producer.ErrVersionGap)
	var gap *producer.VersionGapError
	require.ErrorAs(t, err, &gap)
	require.Equal(t, producer.VersionGapError{AggregateType: "order", AggregateID: "a", Version: 10, Next: 2}, *gap)
	require.ErrorContains(t, err, "AllowVersionGaps")
	requireUsable(t, tx)
	_, _, ok := sequence(t, env, "order", "other")
	require.False(t, ok)
	// Nothing was written: the next version is still 2, for both kinds.
	written, err := p.PublishTxReturning(ctx, tx, orderEvent(t, "a"), orderEvent(t, "other"))
	require.NoError(t, err)
	require.EqualValues(t, 2, written[0].AggregateVersion)
	require.EqualValues(t, 1, written[1].AggregateVersion)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []int64{1, 2}, versionsOf(t, env, "a"))

	// A gap between two supplied versions of one call is refused before
	// any SQL runs.
	err = p.PublishTx(ctx, closedTx(t, env), versioned(t, "a", 3), versioned(t, "a", 5))
	require.ErrorAs(t, err, &gap)
	require.EqualValues(t, 4, gap.Next)

	// The next version is accepted, also after events without a version
	// in the same call.
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "a"), versioned(t, "a", 4), orderEvent(t, "a")))
	require.Equal(t, []int64{1, 2, 3, 4, 5}, versionsOf(t, env, "a"))
	// A first event may be supplied as version 1, not as any other.
	require.ErrorAs(t, p.Publish(ctx, env.Pool, versioned(t, "fresh", 3)), &gap)
	require.NoError(t, p.Publish(ctx, env.Pool, versioned(t, "fresh", 1)))
	// A version that was taken is a conflict, not a gap.
	err = p.Publish(ctx, env.Pool, versioned(t, "a", 5))
	var conflict *producer.VersionConflictError
	require.ErrorAs(t, err, &conflict)
	require.Equal(t, producer.VersionConflictError{AggregateType: "order", AggregateID: "a", Version: 5, Current: 5, Next: 6}, *conflict)
	err = p.Publish(ctx, env.Pool, orderEvent(t, "a"), versioned(t, "a", 6))
	require.ErrorAs(t, err, &conflict)
	require.EqualValues(t, 7, conflict.Next, "the event before it takes version 6")
	require.ErrorContains(t, err, "1 event(s) without a version before it")
}

// TestPublishTxVersionGapOptInCarriesPreviousVersion: with gaps allowed, an
// event records the version it follows, so consumers apply it after that
// one; events without a hole carry nothing extra.
func TestPublishTxVersionGapOptInCarriesPreviousVersion(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducerWith(t, env, producer.Config{AllowVersionGaps: true})
	ctx := context.Background()
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "a"))) // version 1

	tx := mustTx(t, env)
	written, err := p.PublishTxReturning(ctx, tx, versioned(t, "a", 10), orderEvent(t, "a"), versioned(t, "fresh", 5))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	type vp struct{ version, previous int64 }
	got := func(e eventline.Event) vp { return vp{e.AggregateVersion, e.PreviousVersion} }
	require.Equal(t, []vp{{10, 1}, {11, 10}, {5, eventline.NoPreviousVersion}}, []vp{got(written[0]), got(written[1]), got(written[2])})

	stored, md := storedEvent(t, env, written[0].ID)
	require.Equal(t, "1", md[eventline.MetaPreviousVersion])
	require.Equal(t, vp{10, 1}, got(stored))
	stored, md = storedEvent(t, env, written[1].ID)
	require.NotContains(t, md, eventline.MetaPreviousVersion, "no hole: the record carries no predecessor")
	require.Equal(t, vp{11, 10}, got(stored))
	stored, md = storedEvent(t, env, written[2].ID)
	require.Equal(t, "0", md[eventline.MetaPreviousVersion], "a first event numbered 5 follows version 0")
	require.Equal(t, vp{5, eventline.NoPreviousVersion}, got(stored))

	// Events without a version before a supplied one follow the last
	// version; the supplied one follows them.
	tx = mustTx(t, env)
	written, err = p.PublishTxReturning(ctx, tx, orderEvent(t, "a"), versioned(t, "a", 20), orderEvent(t, "a"))
	require.NoError(t, err)
	require.Equal(t, []vp{{12, 11}, {20, 12}, {21, 20}}, []vp{got(written[0]), got(written[1]), got(written[2])})
	// Still not at or below the last version.
	_, err = p.PublishTxReturning(ctx, tx, versioned(t, "a", 21))
	require.ErrorIs(t, err, producer.ErrVersionConflict)
	requireUsable(t, tx)
}

// TestPublishTxUndoesARacedSuppliedVersion builds the race the statement's
// verification exists for: the call reads an aggregate's version, another
// transaction advances it before the call locks the row. The call must
// write nothing (not even the sequence of the new aggregate it created in
// the same statement), report the conflict and leave the transaction
// usable; with gaps allowed, it runs again and the event follows the
// version that is really the last one.
func TestPublishTxUndoesARacedSuppliedVersion(t *testing.T) {
	t.Parallel()
	for _, gaps := range []bool{false, true} {
		env := pgtest.New(t, pgtest.Options{MaxConns: 4})
		p := newProducerWith(t, env, producer.Config{AllowVersionGaps: gaps})
		ctx := context.Background()
		require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "z"))) // z at version 1

		holder := mustTx(t, env)
		require.NoError(t, p.PublishTx(ctx, holder, orderEvent(t, "z"))) // z at 2, locked until commit

		racer := mustTx(t, env)
		var pid uint32
		require.NoError(t, racer.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
		// "a" sorts before "z": the statement creates a's sequence row,
		// then waits for z's lock, having read z at version 1.
		done := make(chan []eventline.Event, 1)
		errc := make(chan error, 1)
		go func() {
			written, err := p.PublishTxReturning(ctx, racer, orderEvent(t, "a"), versioned(t, "z", 2+boolInt(gaps)*8))
			done <- written
			errc <- err
		}()
		waitBlocked(t, env, pid)
		require.NoError(t, holder.Commit(ctx))
		written, err := <-done, <-errc
		requireUsable(t, racer)
		if !gaps {
			var conflict *producer.VersionConflictError
			require.ErrorAs(t, err, &conflict)
			require.Equal(t, producer.VersionConflictError{AggregateType: "order", AggregateID: "z", Version: 2, Current: 2, Next: 3}, *conflict)
			// Nothing of the call is left in the transaction.
			require.NoError(t, racer.Commit(ctx))
			_, _, ok := sequence(t, env, "order", "a")
			require.False(t, ok, "the new aggregate's sequence row was undone")
			require.Empty(t, versionsOf(t, env, "a"))
			v, _, _ := sequence(t, env, "order", "z")
			require.EqualValues(t, 2, v)
			continue
		}
		require.NoError(t, err)
		require.EqualValues(t, 1, written[0].AggregateVersion)
		require.EqualValues(t, 10, written[1].AggregateVersion)
		require.EqualValues(t, 2, written[1].PreviousVersion, "follows the version the other transaction published")
		require.NoError(t, racer.Commit(ctx))
		stored, _ := storedEvent(t, env, written[1].ID)
		require.EqualValues(t, 2, stored.PreviousVersion)
		require.Equal(t, []int64{1}, versionsOf(t, env, "a"))
		v, _, _ := sequence(t, env, "order", "a")
		require.EqualValues(t, 1, v)
	}
}

func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// waitBlocked waits until the backend pid waits for a lock.
func waitBlocked(t *testing.T, env pgtest.Env, pid uint32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var waiting bool
		require.NoError(t, env.Pool.QueryRow(context.Background(),
			`SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting))
		if waiting {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("backend %d never waited for a lock", pid)
}
