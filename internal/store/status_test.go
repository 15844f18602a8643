package store_test

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
)

// TestReadGroupStatusAndCollector: parked events, open gaps (and a parked
// aggregate that is ready, which is no gap), recent skipped gaps, held late
// events and unresolved dead letters are read per group, and the
// collector exposes them as eventline_group_* gauges labelled by group.
func TestReadGroupStatusAndCollector(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	// Group g: acct/a at v1 with v3, v4 parked (gap v2); acct/b with v5
	// parked (gap v1..v4); acct/c at v1 with v3 parked, then released.
	require.Equal(t, store.Next, deliver(t, s, env, "a", 1))
	require.Equal(t, store.Gap, deliver(t, s, env, "a", 3))
	require.Equal(t, store.Gap, deliver(t, s, env, "a", 4))
	require.Equal(t, store.Gap, deliver(t, s, env, "b", 5))
	require.Equal(t, store.Next, deliver(t, s, env, "c", 1))
	require.Equal(t, store.Gap, deliver(t, s, env, "c", 3))
	_, err := s.ReleaseGap(ctx, env.Pool, "g", "acct", "c", "lost")
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

	st, err := s.ReadGroupStatus(ctx, env.Pool, "g", store.ReadGroupStatusOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 4, st.Parked)
	require.Positive(t, st.OldestParked)
	require.EqualValues(t, 2, st.OpenGapCount)
	require.Len(t, st.OpenGaps, 2)
	require.Equal(t, store.OpenGap{AggregateType: "acct", AggregateID: "a", Current: 1, Follows: 2, Version: 3, Parked: 2, Age: st.OpenGaps[0].Age}, st.OpenGaps[0])
	require.Equal(t, store.OpenGap{AggregateType: "acct", AggregateID: "b", Current: 0, Follows: 4, Version: 5, Parked: 1, Age: st.OpenGaps[1].Age}, st.OpenGaps[1])
	require.Equal(t, st.OpenGaps[0].Age, st.OldestGap)
	require.EqualValues(t, 1, st.SkippedGapsRecent, "the release of acct/c; not the 25-hour-old skip")
	require.EqualValues(t, 1, st.LateHeld)
	require.EqualValues(t, 1, st.DeadLetters)

	st, err = s.ReadGroupStatus(ctx, env.Pool, "g", store.ReadGroupStatusOptions{OpenGapsLimit: 1})
	require.NoError(t, err)
	require.EqualValues(t, 2, st.OpenGapCount)
	require.Len(t, st.OpenGaps, 1)

	all, err := s.ReadGroupStatuses(ctx, env.Pool, store.ReadGroupStatusOptions{})
	require.NoError(t, err)
	require.Len(t, all, 2)
	require.Equal(t, "g", all[0].Group)
	require.Equal(t, store.GroupStatus{Group: "other", OpenGaps: []store.OpenGap{}, DeadLetters: 1}, all[1])

	c := s.NewStatusCollector(env.Pool)
	got := gather(t, c)
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

	// A schema that is not there: up is 0, nothing else is reported.
	missing, err := store.New(pgtest.NewSchemaName(t))
	require.NoError(t, err)
	got = gather(t, missing.NewStatusCollector(env.Pool))
	require.Equal(t, map[string]map[string]float64{"eventline_group_status_up": {"": 0}}, got)
	_, err = store.New("bad schema")
	require.Error(t, err)
}

// gather collects c into metric name -> group label -> value.
func gather(t *testing.T, c prometheus.Collector) map[string]map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	families, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]map[string]float64{}
	for _, f := range families {
		out[f.GetName()] = map[string]float64{}
		for _, m := range f.GetMetric() {
			out[f.GetName()][groupLabel(m)] = m.GetGauge().GetValue()
		}
	}
	return out
}

func groupLabel(m *dto.Metric) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == "group" {
			return l.GetValue()
		}
	}
	return ""
}
