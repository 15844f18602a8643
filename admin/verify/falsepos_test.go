package verify_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/admin/verify"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// A dead letter that was replayed is followed to its new outbox row: the
// event is pending again, neither a dead letter nor relayed.
func TestReplayedDeadLetterIsPendingAgain(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1)
	e := f.publish("x", 1)[0]
	f.markRelayed()
	f.deadLetter(e)
	rep := f.run(verify.Config{Groups: []string{"billing"}, GroupTopics: map[string][]string{"billing": {f.topic}}})
	one(t, rep, "x", verify.DeadLetter, verify.Problem, 1)
	require.EqualValues(t, 1, group(t, rep, "billing").DeadLettered)

	res, err := admin.ReplayHeld(f.ctx, f.env.Pool, f.env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter})
	require.NoError(t, err)
	require.Len(t, res.Enqueued, 1)
	rep = f.run(verify.Config{Groups: []string{"billing"}, GroupTopics: map[string][]string{"billing": {f.topic}}})
	p := one(t, rep, "x", verify.Pending, verify.Info, 1)
	require.Equal(t, "outbox", p.Stage, "the replayed row waits for the relay")
	require.True(t, rep.OK)
	g := group(t, rep, "billing")
	require.Equal(t, "config", g.TopicsFrom)
	require.EqualValues(t, 1, g.Events, "the dead row and its replay are one event")
	require.Zero(t, g.DeadLettered)
}

// The window selects events by commit time, and audit rows by their own
// time.
func TestWindowBoundsTheCheck(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1)
	f.createEffects()
	old := f.publish("old", 2)
	recent := f.publish("recent", 2)
	f.markRelayed()
	f.age(old[0], 2*time.Hour)
	f.age(old[1], 2*time.Hour)
	// Both aggregates lost their v1: applied v2, no record of v1.
	f.record("billing", old[1], "applied", 2*time.Hour)
	f.record("billing", recent[1], "applied", time.Minute)

	rep := f.run(verify.Config{})
	require.Len(t, findings(rep, "old"), 1)
	require.Len(t, findings(rep, "recent"), 1)

	since := time.Now().Add(-time.Hour)
	rep = f.run(verify.Config{Since: since})
	require.Empty(t, findings(rep, "old"))
	one(t, rep, "recent", verify.Lost, verify.Problem, 1)
	require.EqualValues(t, 2, rep.Outbox.Events)
	require.Equal(t, since.Unix(), rep.Since.Unix())

	rep = f.run(verify.Config{Until: since})
	one(t, rep, "old", verify.Lost, verify.Problem, 1)
	require.Empty(t, findings(rep, "recent"))
}

// The groups' dead letters (held_events, kind dead_letter) are read: they
// are reported, and the events in them are neither pending nor lost.
func TestConsumerDeadLetterTable(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1)
	evs := f.relayedWithEffects("x", 3)
	f.record("billing", evs[0], "applied", time.Minute)
	f.park("billing", evs[2], time.Minute)

	hs := held.New(f.env.Schema)
	dead := func(e eventline.Event, reason string) int64 {
		id, err := hs.AddDeadLetter(f.ctx, f.env.Pool, held.Event{Group: "billing", MessageUUID: e.ID, EventID: e.ID, EventType: e.Type,
			AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.AggregateVersion, Cause: dedup.KindPermanent, Reason: reason})
		require.NoError(t, err)
		return id
	}
	boom := dead(evs[1], "handler: boom")
	old := dead(evs[0], "handler: old news")
	_, err := hs.Discard(f.ctx, f.env.Pool, held.Filter{IDs: []int64{old}}, "resolved by hand")
	require.NoError(t, err)

	rep := f.run(verify.Config{})
	require.Len(t, findings(rep, "x"), 2, "the dead letter, and v3 parked behind it; the discarded one is resolved")
	dl := ofKind(t, rep, "x", verify.DeadLetter)
	require.Equal(t, verify.Problem, dl.Severity)
	require.EqualValues(t, 2, dl.AggregateVersion)
	require.Equal(t, "billing", dl.Group)
	require.Equal(t, evs[1].ID, dl.EventID)
	require.Contains(t, dl.Detail, "dead-lettered by the group (held event "+strconv.FormatInt(boom, 10)+"; eventline held replay): handler: boom")
	ofKind(t, rep, "x", verify.Parked)
	g := group(t, rep, "billing")
	require.Equal(t, []string{"held_events"}, g.DeadLetterSources)
	require.EqualValues(t, 1, g.ConsumerDeadLetters)
	require.EqualValues(t, 1, g.DeadLettered)
	require.Zero(t, g.Pending)
}

// A group that runs the version gate without dedup records proves nothing
// by a missing record: only its order, parked and skipped events are
// checked.
func TestGroupWithoutDedupRecords(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1)
	f.publish("x", 2)
	f.markRelayed()
	f.setVersion("gate-only", "x", 2)
	rep := f.run(verify.Config{GroupTopics: map[string][]string{"gate-only": {f.topic}}})
	require.True(t, rep.OK)
	require.Empty(t, rep.Findings)
	g := group(t, rep, "gate-only")
	require.False(t, g.Deduplicates)
	require.EqualValues(t, 2, g.Events)
	require.Contains(t, rep.Notes, "group gate-only: keeps versions but no dedup records, so its applied events cannot be told from lost ones; only its order, parked, skipped and dead-lettered events are checked")
}

// Without the consumer tables, the outbox is still checked.
func TestWithoutConsumerTables(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1)
	f.publish("x", 1)
	rep := f.run(verify.Config{ConsumerSchema: "no_such_schema"})
	require.True(t, rep.OK)
	require.Empty(t, rep.Groups)
	require.EqualValues(t, 1, rep.Outbox.Pending)
	require.Contains(t, rep.Notes, "consumer tables: not found in schema no_such_schema (migration 002_consumer is not applied there), so no consumer group was checked")
}

// The order check's two-clock rule, as a property: whatever order an
// aggregate's versions arrive in, writing the dedup rows the way the gate
// does (apply the next version and drain parked successors in the same
// transaction; park early ones, keeping their parked time) is never
// reported out of order; applying one version after a higher one, each in
// its own transaction, always is.
func TestPropertyOutOfOrderOnlyWhenAppliedOutOfOrder(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	processed := sqlident.Qualify(env.Schema, "processed_events")
	run := 0
	rapid.Check(t, func(rt *rapid.T) {
		run++
		group := fmt.Sprintf("g%d", run)
		n := rapid.IntRange(2, 6).Draw(rt, "versions")
		arrival := rapid.Permutation(versionsUpTo(n)).Draw(rt, "arrival")
		broken := rapid.Bool().Draw(rt, "broken")
		insert := func(tx pgx.Tx, v int64, outcome string, at time.Time) {
			_, err := tx.Exec(ctx, `INSERT INTO `+processed+` (consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version, outcome, processed_at)
				VALUES ($1, $2, 'order', 'x', $3, $4, $5)`, group, fmt.Sprintf("%s-%d", group, v), v, outcome, at)
			require.NoError(rt, err)
		}
		clock := time.Now().Add(-time.Hour)
		tick := func() time.Time { clock = clock.Add(time.Second); return clock }
		var current int64
		parked := map[int64]bool{}
		wantOutOfOrder := false
		for _, v := range arrival {
			tx, err := env.Pool.Begin(ctx)
			require.NoError(rt, err)
			at := tick()
			switch {
			case broken:
				// No gate: every event is applied as it arrives.
				insert(tx, v, "applied", at)
				wantOutOfOrder = wantOutOfOrder || v < current
				current = max(current, v)
			case v == current+1:
				insert(tx, v, "applied", at)
				current = v
				for parked[current+1] {
					current++
					delete(parked, current)
					_, err := tx.Exec(ctx, `UPDATE `+processed+` SET outcome = 'applied' WHERE consumer_group = $1 AND event_id = $2`,
						group, fmt.Sprintf("%s-%d", group, current))
					require.NoError(rt, err)
				}
			default:
				insert(tx, v, "parked", at)
				parked[v] = true
			}
			require.NoError(rt, tx.Commit(ctx))
		}
		rep, err := verify.Run(ctx, env.Pool, nil, verify.Config{Schema: env.Schema, Groups: []string{group}})
		require.NoError(rt, err)
		for _, fd := range rep.Findings {
			require.Equal(rt, verify.OutOfOrder, fd.Kind, "%+v", fd)
		}
		reported := len(rep.Findings) > 0
		require.Equal(rt, wantOutOfOrder, reported, "arrival %v, broken %v: %+v", arrival, broken, rep.Findings)
	})
}

func versionsUpTo(n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(i + 1)
	}
	return out
}

// A group whose topic does not exist on Kafka, or
// whose topic is compacted, is checked without them: its relayed events
// stay pending, nothing is lost, and the report says why.
func TestMissingOrCompactedKafkaTopics(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1)
	f.withKafka(1)
	f.createEffects()
	compacted := kafkatest.Topic(t, "compacted")
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	admin, err := sarama.NewClusterAdmin(f.brokers, cfg)
	require.NoError(t, err)
	policy := "compact"
	require.NoError(t, admin.CreateTopic(compacted, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"cleanup.policy": &policy}}, false))
	require.NoError(t, admin.Close())

	f.produce(f.topic, f.publish("x", 1), nil)
	retopic := func(e eventline.Event, topic string) {
		_, err := f.env.Pool.Exec(f.ctx, `UPDATE `+f.shardTable(e)+`
			SET payload = json_build_object('destination_topic', $2::text, 'uuid', payload->>'uuid', 'metadata', payload->'metadata')
			WHERE payload->>'uuid' = $1`, e.ID, topic)
		require.NoError(t, err)
	}
	retopic(f.publish("y", 1)[0], "gone") // a topic deleted since
	retopic(f.publish("z", 1)[0], compacted)
	f.markRelayed()
	rep := f.run(verify.Config{GroupTopics: map[string][]string{"billing": {f.topic, "gone", compacted}}, Groups: []string{"billing"}})
	require.True(t, rep.OK, "%+v", rep.Findings)
	require.Equal(t, "kafka", ofKind(t, rep, "x", verify.Pending).Stage)
	for _, id := range []string{"y", "z"} {
		p := ofKind(t, rep, id, verify.Pending)
		require.Equal(t, "relayed", p.Stage)
		require.Contains(t, p.Detail, "compacted or missing")
	}
	require.Contains(t, rep.Notes, "Kafka topic gone does not exist: its events are not traced on Kafka")
	require.Contains(t, rep.Notes, "Kafka topic "+compacted+" is compacted: an event missing from it proves nothing")
	require.Equal(t, []string{"held_events"}, group(t, rep, "billing").DeadLetterSources)
}

// Config.MaxDetails keeps the oldest findings of a kind and counts the
// rest; the counts still fail the run.
func TestDetailsAreBoundedOldestFirst(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1)
	f.createEffects()
	var lost []string
	for _, id := range []string{"a", "b", "c"} {
		evs := f.publish(id, 2)
		lost = append(lost, evs[0].ID)
		f.record("billing", evs[1], "applied", time.Minute)
	}
	f.markRelayed()
	f.age(eventline.Event{ID: lost[1], AggregateType: "order", AggregateID: "b"}, time.Hour)
	rep := f.run(verify.Config{MaxDetails: 1})
	require.Len(t, rep.Findings, 1)
	require.Equal(t, lost[1], rep.Findings[0].EventID, "the oldest is kept")
	require.Equal(t, []verify.Omitted{{Group: "billing", Kind: verify.Lost, Severity: verify.Problem, Count: 2}}, rep.Omitted)
	require.EqualValues(t, 3, rep.Problems)
	require.False(t, rep.OK)

	rep = f.run(verify.Config{MaxDetails: verify.NoDetails})
	require.Empty(t, rep.Findings)
	require.EqualValues(t, 3, rep.Problems)
}

// An effects query of one column checks for twice-applied events only; the
// order is then read from processed_events. A query that fails or returns
// the wrong columns fails the run with ErrEffectsQuery.
func TestEffectsQueryShapes(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1)
	evs := f.relayedWithEffects("x", 3)
	f.record("billing", evs[0], "applied", 3*time.Minute)
	f.record("billing", evs[2], "applied", 2*time.Minute)
	f.record("billing", evs[1], "applied", time.Minute)
	f.effect(evs[0])
	effects := sqlident.Qualify(f.env.Schema, "effects")

	rep := f.run(verify.Config{EffectsQueries: map[string]string{"billing": "SELECT event_id FROM " + effects + ";\n"}})
	require.EqualValues(t, 1, *group(t, rep, "billing").AppliedTwice)
	ofKind(t, rep, "x", verify.AppliedTwice)
	ooo := ofKind(t, rep, "x", verify.OutOfOrder)
	require.Contains(t, ooo.Detail, "by processed_at and by the transaction that applied it")

	for q, want := range map[string]string{
		"SELECT nope FROM " + effects:                    `column "nope" does not exist`,
		"SELECT event_id, seq, seq FROM " + effects:      "returns 3 columns",
		"DELETE FROM " + effects + " RETURNING event_id": "syntax error",
	} {
		_, err := verify.Run(f.ctx, f.env.Pool, nil, verify.Config{Schema: f.env.Schema, EffectsQueries: map[string]string{"billing": q}})
		require.ErrorIs(t, err, verify.ErrEffectsQuery, q)
		require.ErrorContains(t, err, want)
	}
	require.Equal(t, 4, pgtest.Count(t, f.env.Pool, `SELECT count(*) FROM `+effects), "nothing was deleted")
}

// TestDefaultAgesFollowTheComponentsDefaults: the relay dead-letters an
// event it cannot publish well before DefaultMaxPendingAge, and
// DefaultMaxParkedAge is above the consumer's default park timeout, as
// their comments say.
func TestDefaultAgesFollowTheComponentsDefaults(t *testing.T) {
	var relayGivesUp time.Duration
	for n := 1; n < producer.DefaultMaxAttempts; n++ {
		relayGivesUp += backoff.Delay(eventline.Backoff{Initial: producer.DefaultBackoffInitial, Multiplier: producer.DefaultBackoffMultiplier, Max: producer.DefaultBackoffMax}, n)
	}
	require.Equal(t, 156*time.Second, relayGivesUp, "the relay's dead-letter time quoted in DefaultMaxPendingAge's comment")
	require.Greater(t, verify.DefaultMaxPendingAge, relayGivesUp)
	require.Equal(t, time.Hour, versioning.DefaultParkTimeout, "the park timeout quoted in DefaultMaxParkedAge's comment")
	require.Greater(t, verify.DefaultMaxParkedAge, versioning.DefaultParkTimeout)
}

// TestParkedWithinTheParkTimeoutIsNotAProblem: with the default ages, an
// event parked behind a missing version for less than the consumer's
// default park timeout (here 45 minutes, past the old 30-minute
// DefaultMaxParkedAge) is information; one parked for longer than
// DefaultMaxParkedAge is a problem.
func TestParkedWithinTheParkTimeoutIsNotAProblem(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1)
	const g = "billing"
	f.createEffects()
	waiting, overdue := f.publish("waiting", 3), f.publish("overdue", 3)
	f.markRelayed()
	for _, evs := range [][]eventline.Event{waiting, overdue} {
		f.record(g, evs[0], "applied", 2*time.Hour)
		f.deadLetter(evs[1])
	}
	f.park(g, waiting[2], 45*time.Minute)
	f.park(g, overdue[2], verify.DefaultMaxParkedAge+time.Minute)

	rep := f.run(verify.Config{EffectsQueries: map[string]string{g: f.effectsQuery()}})
	parkedFinding := func(id string) verify.Finding {
		for _, x := range findings(rep, id) {
			if x.Kind == verify.Parked {
				return x
			}
		}
		t.Fatalf("no parked finding for %s: %+v", id, findings(rep, id))
		return verify.Finding{}
	}
	require.Equal(t, verify.Info, parkedFinding("waiting").Severity, "parked within the park timeout: waiting as designed")
	overdueFinding := parkedFinding("overdue")
	require.Equal(t, verify.Problem, overdueFinding.Severity)
	require.Contains(t, overdueFinding.Detail, "is the consumer's sweeper running?")
}

// A record that reused an outbox event's id on another aggregate has a
// dedup record of its own (the id is recorded per aggregate): the outbox
// event is matched with its own record only, and the effects the two left
// under one id are not "applied twice" (each record's handler ran once);
// an id in several aggregates says nothing about order in the effects
// query, so it is left out of that check.
func TestAnIDReusedOnAnotherAggregateIsNoFinding(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1)
	evs := f.relayedWithEffects("x", 2)
	reused := evs[0]
	reused.AggregateID, reused.AggregateVersion = "y", 5
	f.record("billing", reused, "applied", 4*time.Minute)
	f.record("billing", evs[0], "applied", 3*time.Minute)
	f.record("billing", evs[1], "applied", 2*time.Minute)

	rep := f.run(verify.Config{EffectsQueries: map[string]string{"billing": f.effectsQuery()}})
	require.Empty(t, rep.Findings)
	require.True(t, rep.OK)
	require.Zero(t, *group(t, rep, "billing").AppliedTwice)

	f.effect(evs[1])
	rep = f.run(verify.Config{EffectsQueries: map[string]string{"billing": f.effectsQuery()}})
	require.EqualValues(t, 1, *group(t, rep, "billing").AppliedTwice, "an id with one record applied twice still is")
	ofKind(t, rep, "x", verify.AppliedTwice)
}

// TestLateEventsAndSparsePredecessors: a late event held for the operator
// is reported (a warning, counted per group), and a parked event that
// follows an earlier version than the one before it (sparse versions)
// waits for the versions up to its predecessor, not up to its own version
// minus one. Before: no late finding, and "waits for v2..v4".
func TestLateEventsAndSparsePredecessors(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1)
	const g = "billing"
	ev := f.relayedWithEffects("l", 3)
	f.record(g, ev[0], "applied", time.Minute)
	f.skip(g, "l", 2, 2)
	f.record(g, ev[2], "applied", time.Minute)
	f.record(g, ev[1], "late", 0)
	_, err := f.consumer.Pool.Exec(f.ctx, `INSERT INTO `+sqlident.Qualify(f.consumer.Schema, "held_events")+`
		(kind, consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version, previous_version, event_type, message_uuid, payload,
		 header_keys, header_values, cause, reason, current_version)
		VALUES ('late', $1, $2, 'order', 'l', 2, 1, $3, '\x00', '\x7b7d', '{}', '{}', 'arrived_late', 'park timeout: test', 3)`, g, ev[1].ID, ev[1].Type)
	require.NoError(t, err)

	sparse := eventline.Event{ID: eventline.NewEventID(), Type: "order.updated", AggregateType: "order", AggregateID: "s", AggregateVersion: 5, Payload: []byte(`{}`)}
	f.setVersion(g, "s", 1)
	f.park(g, sparse, 0)
	_, err = f.consumer.Pool.Exec(f.ctx, `UPDATE `+sqlident.Qualify(f.consumer.Schema, "parked_events")+` SET previous_version = 3 WHERE event_id = $1`, sparse.ID)
	require.NoError(t, err)

	rep := f.run(verify.Config{})
	late := ofKind(t, rep, "l", verify.Late)
	require.Equal(t, verify.Warning, late.Severity)
	require.Equal(t, ev[1].ID, late.EventID)
	require.Contains(t, late.Detail, "late (arrived_late), held for the operator: park timeout: test")
	require.EqualValues(t, 1, group(t, rep, g).LateHeld)
	parked := ofKind(t, rep, "s", verify.Parked)
	require.Contains(t, parked.Detail, "waits for v2..v3")
	require.True(t, rep.OK, "late and parked events are no problem: %+v", rep.Findings)
}
