package e2e_test

import (
	"context"
	"fmt"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/producer"
)

// TestConsumerKilledInItsFirstJoinGroupIsExpired kills a consumer process
// (SIGKILL) while its first JoinGroup is under way: it is a member of the
// rebalancing group but has not synced. Apache Kafka's group coordinator
// expires it after its session timeout (2 s here) and the group settles
// with the consumer that is left, which then applies every event once, in
// order. kfake never expires such a member (it arms the member's session
// timer only once the JoinGroup response is delivered, and the leader's
// SyncGroup cancels it for members that never synced): the group stays
// stable with the dead member holding its partitions for good, which
// TestConsumerChaosLosesNothing works around by hitting only members of a
// stable group. The time the group takes to settle is measured and logged,
// not asserted beyond a minute.
func TestConsumerKilledInItsFirstJoinGroupIsExpired(t *testing.T) {
	kafkatest.NeedReal(t)
	t.Parallel()
	seed, _ := chaosSeed(t)
	ctx := context.Background()
	env := pgtest.New(t, pgtest.Options{Shards: 1, MaxConns: 8})
	r := newRig(t, env, env.Pool, kafkatest.Start(t, kafkatest.Config{}), "firstjoin", 4, nil)
	effects, deliveries := r.table("firstjoin_effects"), r.table("firstjoin_deliveries")
	_, err := env.Pool.Exec(ctx, `CREATE TABLE `+effects+` (seq bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL, consumer text NOT NULL);
		CREATE TABLE `+deliveries+` (event_id text NOT NULL, consumer text NOT NULL)`)
	require.NoError(t, err)
	rel, err := producer.NewRelay(ctx, env.Pool, producer.RelayConfig{
		Schema: env.Schema, Brokers: r.brokers, PollInterval: 100 * time.Millisecond, Logger: testLogger(),
	})
	require.NoError(t, err)
	stopRelay := relaytest.Background(t, rel.Run)

	group := kafkatest.Topic(t, "firstjoin")
	children := newConsumerChildren(t, r, seed, group, effects, deliveries)
	a := children.start()
	children.waitStable([]*consumerChild{a}, "the first consumer joins")
	stopPublishing, published := r.publishAll(ctx, seed)

	// A second consumer joins; it is killed as soon as the group lists it
	// as a member while still rebalancing (its JoinGroup sent, no
	// SyncGroup yet). A consumer that got through its join before it was
	// seen is stopped, and another tried.
	var victim *consumerChild
	var stateAtKill string
	for attempt := 1; victim == nil; attempt++ {
		require.LessOrEqual(t, attempt, 10, "seed %d: never caught a consumer in its first JoinGroup", seed)
		b := children.start()
		for deadline := time.Now().Add(time.Minute); ; {
			require.True(t, time.Now().Before(deadline), "seed %d: consumer %s never showed up in group %s", seed, b.id, group)
			state, ids := groupMembers(children.admin, group)
			if slices.Contains(ids, b.id) {
				if state == "PreparingRebalance" || state == "CompletingRebalance" {
					b.Kill()
					victim, stateAtKill = b, state
				}
				break
			}
			time.Sleep(5 * time.Millisecond) // polling interval: a join lasts a few hundred ms
		}
		if victim == nil {
			t.Logf("attempt %d: %s finished its join before it could be killed; stopping it", attempt, b.id)
			require.NoError(t, b.Signal(syscall.SIGTERM))
			<-b.Done()
			children.waitStable([]*consumerChild{a}, "after a consumer that joined was stopped")
		}
	}
	killed := time.Now()
	var stillMember time.Duration // how long the dead consumer stayed listed
	for {
		_, ids := groupMembers(children.admin, group)
		if !slices.Contains(ids, victim.id) {
			stillMember = time.Since(killed)
			break
		}
		require.Less(t, time.Since(killed), time.Minute, "seed %d: %s, killed during its first JoinGroup, is still a member of %s a minute later", seed, victim.id, group)
		time.Sleep(20 * time.Millisecond) // polling interval
	}
	settled := children.waitStable([]*consumerChild{a}, "after "+victim.id+" was killed in its first JoinGroup") + stillMember
	t.Logf("%s killed in its first JoinGroup (group %s): listed for %s more, group stable with %s alone %s after the kill (session timeout %s, rebalance timeout %s)",
		victim.id, stateAtKill, stillMember.Round(time.Millisecond), a.id, settled.Round(time.Millisecond), childSessionTimeout, childRebalanceTimeout)

	stopPublishing()
	total := published()
	r.waitAllApplied(ctx, seed, group, effects, total)
	p := &pipeline{t: t, env: env, brokers: r.brokers, topic: r.topic}
	p.waitConsumed(group)
	require.NoError(t, a.Signal(syscall.SIGTERM))
	<-a.Done()
	require.NoError(t, a.Err(), "the remaining consumer stops cleanly")
	stopRelay()
	r.requireAppliedOnceInOrder(seed, effects)
	require.Equal(t, total, r.count(`SELECT count(*) FROM `+effects), "seed %d: every event applied", seed)
	r.requireVerifyClean(ctx, seed, group, effects, total)
	t.Logf("%d events applied once, in order (%s)", total, fmt.Sprint(group))
}
