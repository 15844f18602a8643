package admin_test

import (
	"cmp"
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// bundle is what the status tests share: a migrated schema and its stores.
type bundle struct {
	ctx context.Context
	env pgtest.Env
	vs  *store.Store
}

func setup(t *testing.T, shards int) bundle {
	t.Helper()
	env := pgtest.New(t, pgtest.Options{Shards: shards})
	vs, err := store.New(env.Schema)
	require.NoError(t, err)
	return bundle{ctx: context.Background(), env: env, vs: vs}
}

// readStatus runs admin.ReadStatus as `eventline status` does: in one
// read-only repeatable-read transaction.
func (b bundle) readStatus(t *testing.T, schema string) admin.Status {
	t.Helper()
	var st admin.Status
	err := pgx.BeginTxFunc(b.ctx, b.env.Pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		var err error
		st, err = admin.ReadStatus(b.ctx, tx, schema, 0)
		return err
	})
	require.NoError(t, err)
	return st
}

// dropConsumerTables leaves schema as a producer-only database whose
// consumers keep their tables elsewhere.
func (b bundle) dropConsumerTables(t *testing.T) {
	t.Helper()
	var tables []string
	for _, name := range []string{"skipped_versions", "parked_events", "aggregate_versions", "processed_events"} {
		tables = append(tables, sqlident.Qualify(b.env.Schema, name))
	}
	_, err := b.env.Pool.Exec(b.ctx, `DROP TABLE `+strings.Join(tables, ", "))
	require.NoError(t, err)
}

// park admits versions 1..applied of thing/aggID for group, then parks
// the versions in park, as the consumer's gate would.
func (b bundle) park(t *testing.T, group, aggID string, applied int64, park ...int64) {
	t.Helper()
	admit := func(e eventline.Event, parkIt bool) {
		require.NoError(t, pgx.BeginFunc(b.ctx, b.env.Pool, func(tx pgx.Tx) error {
			if _, err := b.vs.Admit(b.ctx, tx, group, e, false); err != nil || !parkIt {
				return err
			}
			_, err := b.vs.Park(b.ctx, tx, store.ParkRequest{Group: group, Event: e, Handler: "things", Topic: "things", MaxGap: versioning.DefaultMaxGap})
			return err
		}))
	}
	for v := int64(1); v <= applied; v++ {
		admit(consumertest.Event(aggID, v), false)
	}
	for _, v := range park {
		admit(consumertest.Event(aggID, v), true)
	}
}

func TestReadStatus(t *testing.T) {
	t.Parallel()

	t.Run("the outbox, its dead letters and every consumer group", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 3)
		events := relaytest.PublishOrders(t, b.env, "orders", 5, 10, 5)
		perShard := make([]int64, 3)
		for _, e := range events {
			perShard[outbox.ShardFor(e.AggregateType, e.AggregateID, 3)]++
		}
		b.relayDeadLetter(t, 0, "u-1", eventline.Event{})
		b.park(t, "billing", "a", 2, 4)
		b.park(t, "shipping", "x", 0, 3)
		_, err := b.vs.ReleaseGap(b.ctx, b.env.Pool, "shipping", "thing", "x", "test")
		require.NoError(t, err)
		// A group that only ever recorded events without versions.
		batch := &pgx.Batch{}
		rec := b.vs.QueueRecordProcessed(batch, "audit", eventline.Event{ID: eventline.NewEventID(), Type: "ping"}, dedup.OutcomeApplied)
		require.NoError(t, b.env.Pool.SendBatch(b.ctx, batch).Close())
		_, err = rec.Result(b.ctx, b.env.Pool)
		require.NoError(t, err)

		st := b.readStatus(t, b.env.Schema)
		require.EqualValues(t, 10, st.Outbox.Backlog())
		require.Len(t, st.Outbox.Shards, 3)
		for i, s := range st.Outbox.Shards {
			require.Equal(t, perShard[i], s.Backlog, "shard %d", i)
			require.Equal(t, perShard[i], s.Stored, "shard %d", i)
		}
		require.EqualValues(t, 1, st.Outbox.DeadLetters)
		require.Empty(t, st.Owners, "no relay runs")
		require.Len(t, st.Groups, 3)
		audit, billing, shipping := st.Groups[0], st.Groups[1], st.Groups[2]
		require.Equal(t, "audit", audit.Group)
		require.EqualValues(t, 1, audit.Processed)
		require.Zero(t, audit.Parked)
		require.Equal(t, "billing", billing.Group)
		require.EqualValues(t, 3, billing.Processed, "v1, v2 applied and v4 parked are recorded")
		require.EqualValues(t, 1, billing.Parked)
		require.EqualValues(t, 1, billing.OpenGapCount)
		require.Len(t, billing.OpenGaps, 1)
		require.Zero(t, billing.SkippedGaps)
		require.Equal(t, "shipping", shipping.Group)
		require.EqualValues(t, 1, shipping.Processed)
		require.EqualValues(t, 1, shipping.Parked)
		require.EqualValues(t, 1, shipping.SkippedGaps)
		require.EqualValues(t, 2, shipping.SkippedVersions)
		require.EqualValues(t, 1, shipping.SkippedGapsRecent)
	})

	t.Run("a schema not migrated is ErrNotMigrated", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 1)
		schema := pgtest.NewSchemaName(t)
		_, err := admin.ShardOwners(b.ctx, b.env.Pool, schema)
		require.ErrorIs(t, err, producer.ErrNotMigrated)
		_, err = admin.ReadStatus(b.ctx, b.env.Pool, schema, 0)
		require.ErrorIs(t, err, producer.ErrNotMigrated, "no outbox at all")

		// Rolled back past 003_held_events (`eventline migrate down -steps 1`).
		cfg := migrations.Config{Schema: schema, Shards: 1}
		t.Cleanup(func() { pgtest.DropSchema(t, schema) })
		require.NoError(t, migrations.Up(b.ctx, b.env.Pool, cfg))
		require.NoError(t, migrations.Down(b.ctx, b.env.Pool, cfg, 1))
		_, err = admin.ReadStatus(b.ctx, b.env.Pool, schema, 0)
		require.ErrorIs(t, err, producer.ErrNotMigrated, "later migrations rolled back")
		o, err := admin.ReadOutboxStatus(b.ctx, b.env.Pool, schema)
		require.NoError(t, err, "the outbox alone is read, as `eventline migrate down` does before rolling back 001_outbox")
		require.Len(t, o.Shards, 1)
	})

	t.Run("the relays owning the shards", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 2)
		relaytest.Start(t, b.env, producer.RelayConfig{Brokers: kafkatest.Brokers(t), ID: "relay-a"})
		var owners map[int]admin.ShardOwner
		require.Eventually(t, func() bool {
			var err error
			owners, err = admin.ShardOwners(b.ctx, b.env.Pool, b.env.Schema)
			require.NoError(t, err)
			return len(owners) == 2
		}, 30*time.Second, 20*time.Millisecond)
		for shard, o := range owners {
			require.Equal(t, "relay-a", o.Relay, "shard %d", shard)
			require.Positive(t, o.BackendPID)
			require.Positive(t, o.ExpiresIn)
		}
		require.Len(t, b.readStatus(t, b.env.Schema).Owners, 2)
	})
}

// TestCheckPositions: a shard whose position and rows carry transaction
// ids this cluster has not handed out is ahead, in CheckPositions and
// ReadOutboxStatus alike.
func TestCheckPositions(t *testing.T) {
	t.Parallel()
	b := setup(t, 2)
	relaytest.PublishOrders(t, b.env, "orders", 4, 4, 4)
	checks, err := admin.CheckPositions(b.ctx, b.env.Pool, b.env.Schema)
	require.NoError(t, err)
	require.Len(t, checks, 2)
	for _, c := range checks {
		require.False(t, c.Ahead(), "shard %d: %+v", c.Shard, c)
	}

	relaytest.MoveToAHigherCounterCluster(t, b.env, 1)
	checks, err = admin.CheckPositions(b.ctx, b.env.Pool, b.env.Schema)
	require.NoError(t, err)
	require.False(t, checks[0].Ahead())
	require.True(t, checks[1].Ahead())
	require.GreaterOrEqual(t, checks[1].NewestRow, checks[1].Counter)
	st, err := admin.ReadOutboxStatus(b.ctx, b.env.Pool, b.env.Schema)
	require.NoError(t, err)
	require.False(t, st.Shards[0].PositionAhead)
	require.True(t, st.Shards[1].PositionAhead)
}

// TestReadHorizonHolder: an open transaction holding a transaction id is
// found (the oldest in the cluster: another test's may be older).
// Not parallel: it holds back every test's events.
func TestReadHorizonHolder(t *testing.T) {
	b := setup(t, 1)
	holder, err := b.env.Pool.Acquire(b.ctx)
	require.NoError(t, err)
	defer holder.Release()
	_, err = holder.Exec(b.ctx, `SET application_name = 'admin-horizon-test'`)
	require.NoError(t, err)
	tx, err := holder.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	var pid int32
	var xid string
	require.NoError(t, tx.QueryRow(b.ctx, `SELECT pg_backend_pid(), pg_current_xact_id()::text`).Scan(&pid, &xid))

	h, err := admin.ReadHorizonHolder(b.ctx, b.env.Pool)
	require.NoError(t, err)
	require.NotNil(t, h)
	require.NotEmpty(t, h.Xid)
	if h.PID == pid {
		require.Equal(t, xid, h.Xid)
		require.Equal(t, "admin-horizon-test", h.ApplicationName)
		require.Equal(t, "idle in transaction", h.State)
	}

	relaytest.PublishOrders(t, b.env, "orders", 1, 1, 1)
	st, err := admin.ReadOutboxStatus(b.ctx, b.env.Pool, b.env.Schema)
	require.NoError(t, err)
	require.EqualValues(t, 1, st.Shards[0].HeldBack)
	require.NotNil(t, st.HorizonHolder)
}

// TestNewStatusCollector's groups: the consumer groups' gauges on a schema
// with the consumer tables; none at all on a schema without them (a
// producer-only database), rather than eventline_group_status_up 0.
func TestNewStatusCollectorGroups(t *testing.T) {
	t.Parallel()
	b := setup(t, 1)
	b.park(t, "billing", "a", 0, 2)
	gather := func(schema string) *prometheus.Registry {
		t.Helper()
		c, err := admin.NewStatusCollector(b.env.Pool, schema)
		require.NoError(t, err)
		reg := prometheus.NewRegistry()
		require.NoError(t, reg.Register(c))
		return reg
	}
	reg := gather(b.env.Schema)
	require.EqualValues(t, 1, metrictest.Sum(t, reg, "eventline_group_status_up"))
	require.EqualValues(t, 1, metrictest.Sum(t, reg, "eventline_group_parked_events"))

	// A consumer-only schema (no outbox): the groups' series, no
	// eventline_outbox_* series at all (not eventline_outbox_up 0).
	consumerOnly := setup(t, 1)
	consumerOnly.park(t, "billing", "a", 0, 2)
	_, err := b.env.Pool.Exec(b.ctx, `DROP TABLE `+sqlident.Qualify(consumerOnly.env.Schema, "outbox_config"))
	require.NoError(t, err)
	reg = gather(consumerOnly.env.Schema)
	require.EqualValues(t, 1, metrictest.Sum(t, reg, "eventline_group_parked_events"))
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		require.NotContains(t, f.GetName(), "eventline_outbox_", "no eventline_outbox_* series on a schema without an outbox")
	}

	// A producer-only schema (its consumers keep their tables elsewhere):
	// no eventline_group_* series, the outbox's are there.
	b.dropConsumerTables(t)
	families, err = gather(b.env.Schema).Gather()
	require.NoError(t, err)
	for _, f := range families {
		require.NotContains(t, f.GetName(), "eventline_group_", "no eventline_group_* series on a schema without consumer tables")
	}
	require.NotEmpty(t, families, "the outbox's series are there")
}

// TestFindOutboxVersions: the newest outbox row of each wanted version,
// with its shard, envelope and whether the relay passed it; versions
// without a row are absent, and a schema without an outbox is
// ErrNotMigrated.
func TestFindOutboxVersions(t *testing.T) {
	t.Parallel()
	b := setup(t, 2)
	events := relaytest.PublishOrders(t, b.env, "orders", 1, 2, 2)
	want := []admin.AggregateVersion{
		{AggregateType: "order", AggregateID: "agg-0", Version: 1},
		{AggregateType: "order", AggregateID: "agg-0", Version: 2},
		{AggregateType: "order", AggregateID: "agg-0", Version: 9},
		{AggregateType: "order", AggregateID: "agg-1", Version: 1},
	}
	found, err := admin.FindOutboxVersions(b.ctx, b.env.Pool, b.env.Schema, want)
	require.NoError(t, err)
	require.Len(t, found, 2)
	slices.SortFunc(found, func(x, y admin.OutboxVersion) int { return cmp.Compare(x.Version, y.Version) })
	for i, f := range found {
		require.Equal(t, want[i], f.AggregateVersion)
		require.Equal(t, outbox.ShardFor("order", "agg-0", 2), f.Shard)
		require.Equal(t, events[i].ID, f.EventID)
		require.Equal(t, "orders", f.Topic)
		require.NotEmpty(t, f.MessageUUID)
		require.WithinDuration(t, time.Now(), f.Committed, time.Minute)
		require.False(t, f.Relayed, "no relay ran")
	}

	_, err = b.env.Pool.Exec(b.ctx, `DROP TABLE `+sqlident.Qualify(b.env.Schema, "outbox_config"))
	require.NoError(t, err)
	_, err = admin.FindOutboxVersions(b.ctx, b.env.Pool, b.env.Schema, want)
	require.ErrorIs(t, err, producer.ErrNotMigrated)
}

// deliver runs version v of acct/id through group g's gate, parking it on
// a gap as the consumer would, and returns the gate's verdict.
func (b bundle) deliver(t *testing.T, id string, v int64) store.Verdict {
	t.Helper()
	e := eventline.Event{ID: eventline.NewEventID(), Type: "t", AggregateType: "acct", AggregateID: id, AggregateVersion: v, Payload: []byte(`{}`)}
	var verdict store.Verdict
	require.NoError(t, pgx.BeginFunc(b.ctx, b.env.Pool, func(tx pgx.Tx) error {
		a, err := b.vs.Admit(b.ctx, tx, "g", e, false)
		if err != nil {
			return err
		}
		verdict = a.Verdict
		if a.Verdict == store.Gap {
			_, err = b.vs.Park(b.ctx, tx, store.ParkRequest{Group: "g", Event: e, Handler: "h", Current: a.Previous, MaxGap: versioning.DefaultMaxGap})
		}
		return err
	}))
	return verdict
}

// TestReadStatusGroupsAndCollector: parked events, open gaps (and a parked
// aggregate that is ready, which is no gap), recent skipped gaps, held late
// events and unresolved dead letters are read per group, and the
// collector exposes them as eventline_group_* gauges labelled by group.
func TestReadStatusGroupsAndCollector(t *testing.T) {
	t.Parallel()
	b := setup(t, 1)
	ctx, env := b.ctx, b.env
	// Group g: acct/a at v1 with v3, v4 parked (gap v2); acct/b with v5
	// parked (gap v1..v4); acct/c at v1 with v3 parked, then released.
	require.Equal(t, store.Next, b.deliver(t, "a", 1))
	require.Equal(t, store.Gap, b.deliver(t, "a", 3))
	require.Equal(t, store.Gap, b.deliver(t, "a", 4))
	require.Equal(t, store.Gap, b.deliver(t, "b", 5))
	require.Equal(t, store.Next, b.deliver(t, "c", 1))
	require.Equal(t, store.Gap, b.deliver(t, "c", 3))
	_, err := b.vs.ReleaseGap(ctx, env.Pool, "g", "acct", "c", "lost")
	require.NoError(t, err)
	// An old skip outside the 24-hour window, two late events and two dead
	// letters of which one of each is resolved, a group with only a dead
	// letter, and the relay's dead letter (no group's).
	_, err = env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "skipped_versions")+
		` (consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason, skipped_at)
		VALUES ('g', 'acct', 'z', 1, 1, 'old', now() - interval '25 hours')`)
	require.NoError(t, err)
	_, err = env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "held_events")+
		` (kind, consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version, previous_version, event_type, message_uuid, payload,
			header_keys, header_values, cause, reason, current_version, status)
		VALUES ('late', 'g', 'late-1', 'acct', 'z', 1, 0, 't', '\x00', '\x7b7d', '{}', '{}', 'arrived_late', 'old', 2, 'held'),
			('late', 'g', 'late-2', 'acct', 'z', 2, 1, 't', '\x00', '\x7b7d', '{}', '{}', 'arrived_late', 'old', 2, 'replayed')`)
	require.NoError(t, err)
	_, err = env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "held_events")+
		` (kind, consumer_group, message_uuid, payload, header_keys, header_values, cause, reason, status)
		VALUES ('dead_letter', 'g', '\x01', '\x00', '{}', '{}', 'permanent', 'r', 'held'),
			('dead_letter', 'g', '\x02', '\x00', '{}', '{}', 'permanent', 'r', 'replayed'),
			('dead_letter', 'other', '\x03', '\x00', '{}', '{}', 'permanent', 'r', 'replay_requested')`)
	require.NoError(t, err)
	require.NoError(t, held.New(env.Schema).AddRelay(ctx, env.Pool, held.Event{Cause: held.CauseRejected, Reason: "r", MessageUUID: "u"}))

	readGroups := func(openGaps int) []admin.GroupStatus {
		t.Helper()
		st, err := admin.ReadStatus(ctx, env.Pool, env.Schema, openGaps)
		require.NoError(t, err)
		return st.Groups
	}
	all := readGroups(0)
	require.Len(t, all, 2)
	require.Equal(t, "g", all[0].Group)
	st := all[0]
	require.EqualValues(t, 4, st.Parked)
	require.Positive(t, st.OldestParked)
	require.EqualValues(t, 2, st.OpenGapCount)
	require.Len(t, st.OpenGaps, 2)
	require.Equal(t, admin.OpenGap{AggregateType: "acct", AggregateID: "a", Current: 1, Follows: 2, Version: 3, Parked: 2, Age: st.OpenGaps[0].Age}, st.OpenGaps[0])
	require.Equal(t, admin.OpenGap{AggregateType: "acct", AggregateID: "b", Current: 0, Follows: 4, Version: 5, Parked: 1, Age: st.OpenGaps[1].Age}, st.OpenGaps[1])
	require.Equal(t, st.OpenGaps[0].Age, st.OldestGap)
	require.EqualValues(t, 1, st.SkippedGapsRecent, "the release of acct/c; not the 25-hour-old skip")
	require.EqualValues(t, 1, st.LateHeld)
	require.EqualValues(t, 1, st.DeadLetters)
	require.Equal(t, admin.GroupStatus{Group: "other", OpenGaps: []admin.OpenGap{}, DeadLetters: 1}, all[1])

	st = readGroups(1)[0]
	require.EqualValues(t, 2, st.OpenGapCount)
	require.Len(t, st.OpenGaps, 1)

	c, err := admin.NewStatusCollector(env.Pool, env.Schema)
	require.NoError(t, err)
	got := gatherGroups(t, c)
	require.Equal(t, 1.0, got["eventline_group_status_up"][""])
	require.Equal(t, 4.0, got["eventline_group_parked_events"]["g"])
	require.Equal(t, 2.0, got["eventline_group_open_gaps"]["g"])
	require.Positive(t, got["eventline_group_oldest_open_gap_seconds"]["g"])
	require.Positive(t, got["eventline_group_oldest_parked_seconds"]["g"])
	require.Equal(t, 1.0, got["eventline_group_skipped_gaps_24h"]["g"])
	require.Equal(t, 1.0, got["eventline_group_late_events"]["g"])
	require.Equal(t, 1.0, got["eventline_group_dead_letters"]["g"])
	require.Equal(t, 1.0, got["eventline_group_dead_letters"]["other"])
	require.Equal(t, 0.0, got["eventline_group_parked_events"]["other"])

	// A schema whose consumer tables cannot be read (one of them is
	// there, the rest not): up is 0, nothing else is reported.
	broken := pgtest.NewSchemaName(t)
	t.Cleanup(func() { pgtest.DropSchema(t, broken) })
	_, err = env.Pool.Exec(ctx, `CREATE SCHEMA `+sqlident.Quote(broken)+`; CREATE TABLE `+sqlident.Qualify(broken, "aggregate_versions")+` (consumer_group text)`)
	require.NoError(t, err)
	c, err = admin.NewStatusCollector(env.Pool, broken)
	require.NoError(t, err)
	got = gatherGroups(t, c)
	require.Equal(t, map[string]map[string]float64{"eventline_group_status_up": {"": 0}}, got)
}

// gatherGroups collects c into metric name -> group label -> value.
func gatherGroups(t *testing.T, c prometheus.Collector) map[string]map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	families, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]map[string]float64{}
	for _, f := range families {
		out[f.GetName()] = map[string]float64{}
		for _, m := range f.GetMetric() {
			group := ""
			for _, l := range m.GetLabel() {
				if l.GetName() == "group" {
					group = l.GetValue()
				}
			}
			out[f.GetName()][group] = m.GetGauge().GetValue()
		}
	}
	return out
}
