package producer_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// With a poll interval of a minute, only a notification can deliver these
// events within the tests' 15 seconds.
const sleepy = time.Minute

func waitingShards(t *testing.T, env pgtest.Env) int {
	return pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(env.Schema, "outbox_waiting"))
}

func TestIdleRelayIsWokenByInsert(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 2}, 2)
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, PollInterval: sleepy})

	// Idle shards ask producers to notify them...
	require.Eventually(t, func() bool { return waitingShards(t, env) == 2 }, 15*time.Second, 10*time.Millisecond)
	for round := 1; round <= 3; round++ {
		events := relaytest.PublishOrders(t, env, topic, 1, 1, 1)
		recs := relaytest.ReadUntil(t, brokers, topic, 15*time.Second, func(r []relaytest.Record) bool { return len(r) == round })
		require.Len(t, recs, round, "round %d: the insert must wake the relay", round)
		require.Equal(t, events[0].ID, recs[round-1].EventID)
		// ...and ask again once they are idle again.
		require.Eventually(t, func() bool { return waitingShards(t, env) == 2 }, 15*time.Second, 10*time.Millisecond)
	}
}

// TestRelayDoesNotSleepThroughAnInsertThatMissedItsRequest: a producer
// inserts before the relay asked to be notified and commits after, so its
// trigger saw no request and sent no notification. The relay must not sleep
// through it: before sleeping it waits for every transaction older than
// its request.
func TestRelayDoesNotSleepThroughAnInsertThatMissedItsRequest(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1}, 1)
	p := newProducerWith(t, env, producer.Config{DefaultTopic: topic})
	ctx := context.Background()

	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	e := relaytest.Event(t, "late", topic, 1)
	require.NoError(t, p.PublishTx(ctx, tx, e)) // no relay is waiting: no NOTIFY

	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, PollInterval: sleepy})
	require.Eventually(t, func() bool { return waitingShards(t, env) == 1 }, 15*time.Second, 10*time.Millisecond)
	time.Sleep(200 * time.Millisecond) // the relay is now waiting for tx to end
	require.NoError(t, tx.Commit(ctx))

	recs := relaytest.ReadTopic(t, brokers, topic, 1, 15*time.Second)
	require.Len(t, recs, 1, "the relay slept through a committed event")
	require.Equal(t, e.ID, recs[0].EventID)
}

// TestBusyRelayIsNotNotified: while a relay is draining, producers do not
// send NOTIFYs (each one would serialize their commits).
func TestBusyRelayIsNotNotified(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	require.Zero(t, waitingShards(t, env), "no relay runs: nobody asks to be notified")
	ctx := context.Background()
	conn, err := env.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, `LISTEN eventline_outbox`)
	require.NoError(t, err)
	// The channel is shared by every schema (other tests run in parallel):
	// count only this schema's notifications.
	mine := func(timeout time.Duration) int {
		wctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		n := 0
		for {
			note, err := conn.Conn().WaitForNotification(wctx)
			if err != nil {
				return n
			}
			if note.Payload == env.Schema+".0" {
				n++
			}
		}
	}
	relaytest.PublishOrders(t, env, "orders", 1, 5, 1)
	require.Zero(t, mine(300*time.Millisecond), "an insert notified although no relay was waiting")

	// The request of a relay that died lapses: no more notifications.
	waiting := sqlident.Qualify(env.Schema, "outbox_waiting")
	_, err = env.Pool.Exec(ctx, `INSERT INTO `+waiting+` (shard, expires_at) VALUES (0, now() - interval '1 second')`)
	require.NoError(t, err)
	relaytest.PublishOrders(t, env, "orders", 1, 1, 1)
	require.Zero(t, mine(300*time.Millisecond), "an expired request was notified")

	_, err = env.Pool.Exec(ctx, `UPDATE `+waiting+` SET expires_at = now() + interval '1 minute'`)
	require.NoError(t, err)
	relaytest.PublishOrders(t, env, "orders", 1, 1, 1)
	require.Equal(t, 1, mine(2*time.Second), "a waiting shard must be notified")
	_ = conn.Conn().Close(ctx) // it was listening: do not return it to the pool
}

// TestRelayReadsRowsAsSoonAsTheHorizonPasses: committed rows held back by an
// older open transaction become readable the moment it ends, and nothing
// notifies the relay then (no insert happens). The relay must keep looking
// instead of sleeping: here the old transaction stays open 4s, long enough
// for a backing-off poll to sleep for hundreds of milliseconds, and the
// relay must poll all along (every 20 ms at most once the stall is 2 s
// old; the test asks for at least one poll per 200 ms on average, which
// the relay that slept up to 500 ms in that state did not make) and then
// record the held-back event. The time from the horizon's end to that is
// logged, not asserted: on a loaded machine it says more about the
// machine than about the relay.
func TestRelayReadsRowsAsSoonAsTheHorizonPasses(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1, MaxConns: 10}, 1)
	rel, _ := relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, PollInterval: time.Second})
	require.Eventually(t, func() bool { return waitingShards(t, env) == 1 }, 15*time.Second, 10*time.Millisecond)
	ctx := context.Background()

	for round := 0; round < 5; round++ {
		holder, err := env.Pool.Begin(ctx)
		require.NoError(t, err)
		_, err = holder.Exec(ctx, `SELECT pg_current_xact_id()`)
		require.NoError(t, err)
		relaytest.PublishOrders(t, env, topic, 1, 1, 1) // committed, held back by holder
		var tx string
		var off int64
		require.NoError(t, env.Pool.QueryRow(ctx, `SELECT transaction_id::text, "offset" FROM `+sqlident.Qualify(env.Schema, "outbox_0")+
			` ORDER BY transaction_id DESC, "offset" DESC LIMIT 1`).Scan(&tx, &off))
		want, _ := strconv.ParseUint(tx, 10, 64)
		const hold = 4 * time.Second
		polls := producer.Polls(rel)
		time.Sleep(hold) // the horizon is held this long: the stall the relay's poll backs off in
		polled := producer.Polls(rel) - polls
		require.NoError(t, holder.Rollback(ctx))
		require.GreaterOrEqual(t, polled, int64(hold/(200*time.Millisecond)), "round %d: the relay slept while committed rows waited behind the horizon", round)
		ended := time.Now()
		var took time.Duration
		require.Eventually(t, func() bool {
			ptx, poff, err := positionOf(ctx, env.Pool, env.Schema, 0)
			if err == nil && (ptx > want || ptx == want && poff >= off) {
				took = time.Since(ended)
				return true
			}
			return false
		}, 30*time.Second, 2*time.Millisecond)
		t.Logf("round %d: %d polls while held back; relayed %s after the horizon passed", round, polled, took.Round(time.Millisecond))
	}
}
