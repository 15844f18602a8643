package producer_test

import (
	"context"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/producer"
)

// TestRelayForwardsCommittedEventsOnceUnderOverlappingTransactions runs
// many producers whose transactions overlap and commit out of start order,
// some holding an early transaction id for a long time, some rolling back,
// while the relay runs. Every committed event must reach Kafka exactly once
// (nothing skipped because it committed late), and nothing rolled back.
func TestRelayForwardsCommittedEventsOnceUnderOverlappingTransactions(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 4, MaxConns: 20}, 6)
	p := newProducerWith(t, env, producer.Config{DefaultTopic: topic})
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, BatchSize: 16})

	var mu sync.Mutex
	committed, rolledBack := map[string]bool{}, map[string]bool{}
	var wg sync.WaitGroup
	for w := 0; w < 12; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := 0; i < 25; i++ {
				var events []eventline.Event
				for j := 0; j <= rng.IntN(3); j++ {
					e, err := eventline.NewJSONEvent("order.updated", "order", "agg-"+strconv.Itoa(rng.IntN(10)), map[string]int{"w": w})
					require.NoError(t, err)
					e.ID = eventline.NewEventID()
					events = append(events, e)
				}
				rollback := rng.IntN(5) == 0
				err := pgx.BeginFunc(context.Background(), env.Pool, func(tx pgx.Tx) error {
					if rng.IntN(4) == 0 {
						// Take a transaction id now and write much later: this
						// row sorts early in the outbox but commits late.
						if _, err := tx.Exec(context.Background(), `SELECT pg_current_xact_id()`); err != nil {
							return err
						}
						time.Sleep(time.Duration(50+rng.IntN(150)) * time.Millisecond)
					}
					if err := p.PublishTx(context.Background(), tx, events...); err != nil {
						return err
					}
					time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
					if rollback {
						return errRollback
					}
					return nil
				})
				if rollback {
					require.ErrorIs(t, err, errRollback)
				} else {
					require.NoError(t, err)
				}
				mu.Lock()
				for _, e := range events {
					if rollback {
						rolledBack[e.ID] = true
					} else {
						committed[e.ID] = true
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	require.NotEmpty(t, rolledBack)

	records := relaytest.ReadTopic(t, brokers, topic, len(committed), time.Minute)
	// Read on for a moment: a late duplicate or rolled-back event would
	// show up here.
	records = relaytest.ReadUntil(t, brokers, topic, 2*time.Second, func(r []relaytest.Record) bool { return len(r) > len(records) })
	counts := relaytest.Distinct(records)
	for id := range committed {
		require.Equal(t, 1, counts[id], "committed event %s must be forwarded exactly once", id)
	}
	for id := range rolledBack {
		require.Zero(t, counts[id], "rolled-back event %s was forwarded", id)
	}
	require.Len(t, counts, len(committed))
}

var errRollback = errorString("roll back on purpose")

type errorString string

func (e errorString) Error() string { return string(e) }

// TestXidOrderCanInvertVersions builds the inversion DESIGN.md describes on
// purpose: transaction A takes its transaction id first but locks the
// aggregate last, so its version 2 sorts before B's version 1 in the outbox
// and reaches Kafka first. The relay must not "fix" this by reordering (it
// acknowledges by offset); the consumer's version gate restores order,
// which the end-to-end tests check.
func TestXidOrderCanInvertVersions(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1}, 1)
	p := newProducerWith(t, env, producer.Config{DefaultTopic: topic})
	ctx := context.Background()

	txA, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer txA.Rollback(ctx)
	_, err = txA.Exec(ctx, `SELECT pg_current_xact_id()`) // A's xid is older
	require.NoError(t, err)

	b := relaytest.Event(t, "X", topic, "b")
	require.NoError(t, p.Publish(ctx, env.Pool, b)) // B: version 1, commits first
	a := relaytest.Event(t, "X", topic, "a")
	require.NoError(t, p.PublishTx(ctx, txA, a)) // A: version 2
	require.NoError(t, txA.Commit(ctx))

	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers})
	recs := relaytest.ReadTopic(t, brokers, topic, 2, 30*time.Second)
	require.Len(t, recs, 2)
	require.Equal(t, []int64{2, 1}, []int64{recs[0].Version, recs[1].Version},
		"outbox order is transaction-id order, not commit or version order")
}
