package verify_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin/verify"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/kafkatest"
)

// seeded is a database (and, with Kafka, a topic) with one aggregate per
// kind of defect, made by hand.
type seeded struct {
	group  string
	topic  string
	events map[string][]eventline.Event
}

// seedDefects writes, for group billing (unique per test when Kafka is
// shared), one aggregate per case:
//
//	clean       v1, v2 relayed and applied
//	lost        v1..v3 relayed; v1 and v3 applied, no record of v2
//	ooo         v1..v3 applied in the order v1, v3, v2
//	parked      v1 applied; v2 dead-lettered by the relay; v3 parked
//	skipped     v1, v3 applied; v2 given up on (skipped_versions)
//	twice       v1 applied; the group's effects table has it twice
//	old         v1 relayed 30 days ago; version 1, no record (retention)
//	pending     committed a moment ago, not relayed
//	stuck       committed an hour ago, not relayed
//
// and with Kafka:
//
//	unrecorded  on Kafka, below the group's committed offset, no record
//	dlq         on Kafka, consumed, held by the group as a dead letter
//	missing     relayed, not on Kafka
//	onkafka     on Kafka, above the group's committed offset
func seedDefects(t *testing.T, f *fixture, withKafka bool) seeded {
	t.Helper()
	s := seeded{group: "billing", events: map[string][]eventline.Event{}, topic: f.topic}
	if withKafka {
		s.group = kafkatest.Topic(t, "billing")
	}
	g := s.group
	f.createEffects()
	cases := []struct {
		id string
		n  int
	}{{"clean", 2}, {"lost", 3}, {"ooo", 3}, {"parked", 3}, {"skipped", 3}, {"twice", 1}, {"old", 1}}
	if withKafka {
		cases = append(cases, []struct {
			id string
			n  int
		}{{"unrecorded", 1}, {"dlq", 1}, {"missing", 1}, {"onkafka", 1}}...)
	}
	for _, c := range cases {
		s.events[c.id] = f.publish(c.id, c.n)
	}
	f.markRelayed()
	s.events["pending"] = f.publish("pending", 1)
	s.events["stuck"] = f.publish("stuck", 1)
	f.age(s.events["stuck"][0], time.Hour)
	f.age(s.events["old"][0], 30*24*time.Hour)

	ev := s.events
	f.record(g, ev["clean"][0], "applied", 5*time.Minute)
	f.record(g, ev["clean"][1], "applied", 5*time.Minute)
	f.record(g, ev["lost"][0], "applied", 5*time.Minute)
	f.record(g, ev["lost"][2], "applied", 4*time.Minute)
	f.record(g, ev["ooo"][0], "applied", 3*time.Minute)
	f.record(g, ev["ooo"][2], "applied", 2*time.Minute)
	f.record(g, ev["ooo"][1], "applied", time.Minute)
	f.record(g, ev["parked"][0], "applied", 3*time.Minute)
	f.deadLetter(ev["parked"][1])
	f.park(g, ev["parked"][2], time.Minute)
	f.record(g, ev["skipped"][0], "applied", 3*time.Minute)
	f.skip(g, "skipped", 2, 2)
	f.record(g, ev["skipped"][2], "applied", 2*time.Minute)
	f.record(g, ev["twice"][0], "applied", time.Minute)
	f.effect(ev["twice"][0])
	f.setVersion(g, "old", 1)

	if withKafka {
		var onKafka []eventline.Event
		for _, c := range cases {
			for _, e := range ev[c.id] {
				if c.id == "missing" || c.id == "onkafka" || e.ID == ev["parked"][1].ID {
					continue
				}
				onKafka = append(onKafka, e)
			}
		}
		f.produce(f.topic, onKafka, nil)
		f.commitAll(g, f.topic)
		f.produce(f.topic, ev["onkafka"], nil)
		for _, e := range ev["dlq"] {
			_, err := held.New(f.consumer.Schema).AddDeadLetter(f.ctx, f.consumer.Pool, held.Event{Group: g, MessageUUID: e.ID, EventID: e.ID,
				EventType: e.Type, AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.AggregateVersion,
				Cause: "permanent", Reason: "no handler for event type \"order.updated\""})
			require.NoError(t, err)
		}
	}
	return s
}

// checkSeeded asserts that each seeded defect is reported, and nothing
// else.
func checkSeeded(t *testing.T, rep *verify.Report, s seeded, withKafka bool) {
	t.Helper()
	ev := s.events
	require.Empty(t, findings(rep, "clean"))
	lost := one(t, rep, "lost", verify.Lost, verify.Problem, 2)
	require.Equal(t, ev["lost"][1].ID, lost.EventID)
	require.Contains(t, lost.Detail, "the group's version of order/lost is 3")
	ooo := one(t, rep, "ooo", verify.OutOfOrder, verify.Problem, 2)
	require.Equal(t, ev["ooo"][1].ID, ooo.EventID)
	require.Contains(t, ooo.Detail, "v2 was applied after v3")

	parked := findings(rep, "parked")
	require.Len(t, parked, 2, "%+v", parked)
	for _, p := range parked {
		switch p.Kind {
		case verify.DeadLetter:
			require.Equal(t, verify.Problem, p.Severity)
			require.Empty(t, p.Group, "the relay's dead letter")
			require.EqualValues(t, 2, p.AggregateVersion)
			require.Contains(t, p.Detail, "gave up after 5 attempts")
			require.Contains(t, p.Detail, "eventline held replay")
		case verify.Parked:
			require.Equal(t, verify.Info, p.Severity)
			require.EqualValues(t, 3, p.AggregateVersion)
			require.Contains(t, p.Detail, "the aggregate is at v1 and waits for v2")
		default:
			t.Fatalf("unexpected finding %+v", p)
		}
	}
	skipped := one(t, rep, "skipped", verify.Skipped, verify.Warning, 2)
	require.EqualValues(t, 2, skipped.ToVersion)
	twice := one(t, rep, "twice", verify.AppliedTwice, verify.Problem, 1)
	require.Contains(t, twice.Detail, "2 times")
	require.Empty(t, findings(rep, "old"), "a missing record older than the dedup horizon is not lost")
	pending := one(t, rep, "pending", verify.Pending, verify.Info, 1)
	require.Equal(t, "outbox", pending.Stage)
	stuck := one(t, rep, "stuck", verify.Pending, verify.Problem, 1)
	require.Contains(t, stuck.Detail, "stuck")
	require.GreaterOrEqual(t, stuck.AgeSeconds, 3600.0)

	g := group(t, rep, s.group)
	require.True(t, g.Deduplicates)
	require.Equal(t, []string{s.topic}, g.Topics)
	require.EqualValues(t, 1, g.Parked)
	require.EqualValues(t, 1, g.SkippedGaps)
	require.EqualValues(t, 1, g.SkippedVersions)
	require.EqualValues(t, 1, g.SkippedEvents)
	require.EqualValues(t, 1, g.OutOfOrder)
	require.NotNil(t, g.AppliedTwice)
	require.EqualValues(t, 1, *g.AppliedTwice)
	require.EqualValues(t, 1, g.Unverifiable)
	require.EqualValues(t, 1, g.Stuck)
	require.EqualValues(t, 1, g.Outcomes["parked"])
	require.EqualValues(t, 1, rep.Outbox.DeadLetters)
	require.EqualValues(t, 2, rep.Outbox.Pending)
	wantProblems := 5 // lost, out of order, dead letter, stuck, twice
	if withKafka {
		wantProblems += 3 // unrecorded, missing, dlq
		unrecorded := one(t, rep, "unrecorded", verify.Lost, verify.Problem, 1)
		require.Contains(t, unrecorded.Detail, "committed offset there is")
		require.Contains(t, unrecorded.Detail, "no dedup record of this event (nor a dead letter)")
		missing := one(t, rep, "missing", verify.Lost, verify.Problem, 1)
		require.Contains(t, missing.Detail, "not on Kafka topic")
		dlq := one(t, rep, "dlq", verify.DeadLetter, verify.Problem, 1)
		require.Equal(t, s.group, dlq.Group)
		require.Contains(t, dlq.Detail, "no handler for event type")
		onKafka := one(t, rep, "onkafka", verify.Pending, verify.Info, 1)
		require.Equal(t, "kafka", onKafka.Stage)
		require.Equal(t, "kafka", g.TopicsFrom)
		require.EqualValues(t, 3, g.Lost)
		require.EqualValues(t, 1, g.ConsumerDeadLetters)
		require.Equal(t, []string{"held_events"}, g.DeadLetterSources)
	} else {
		require.Equal(t, "records", g.TopicsFrom)
		require.EqualValues(t, 1, g.Lost)
	}
	require.EqualValues(t, wantProblems, rep.Problems, "findings: %+v", rep.Findings)
	require.EqualValues(t, 1, rep.Warnings)
	require.False(t, rep.OK)
}

func TestEachSeededDefectIsReported(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 3)
	s := seedDefects(t, f, false)
	rep := f.run(verify.Config{EffectsQueries: map[string]string{s.group: f.effectsQuery()}})
	checkSeeded(t, rep, s, false)
	require.False(t, rep.Kafka.Checked)
	require.False(t, rep.SeparateConsumerDatabase)
}

func TestEachSeededDefectIsReportedWithKafka(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 3)
	f.withKafka(3)
	s := seedDefects(t, f, true)
	rep := f.run(verify.Config{EffectsQueries: map[string]string{s.group: f.effectsQuery()}})
	checkSeeded(t, rep, s, true)
	require.True(t, rep.Kafka.Checked)
}

func TestEachSeededDefectIsReportedFromASeparateConsumerDatabase(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 3)
	f.withKafka(2)
	f.separateConsumer()
	s := seedDefects(t, f, true)
	// Chunks of two events make the lookups cross chunk boundaries.
	rep := f.run(verify.Config{ChunkSize: 2, EffectsQueries: map[string]string{s.group: f.effectsQuery()}})
	require.True(t, rep.SeparateConsumerDatabase)
	checkSeeded(t, rep, s, true)
}

// Without an effects query, the order check reads processed_events: the
// out-of-order aggregate is still reported, applied twice is not checked.
func TestOutOfOrderFromProcessedEvents(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 2)
	s := seedDefects(t, f, false)
	rep := f.run(verify.Config{})
	one(t, rep, "ooo", verify.OutOfOrder, verify.Problem, 2)
	require.Empty(t, findings(rep, "twice"))
	require.Nil(t, group(t, rep, s.group).AppliedTwice)
}
