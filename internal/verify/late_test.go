package verify_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/verify"
)

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
