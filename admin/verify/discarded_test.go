package verify_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin/verify"
	"github.com/eventline/eventline/internal/sqlident"
)

// TestStaleEventWhoseVersionAnotherEventTookIsReported: the version gate
// discards an event as stale when its aggregate is at or past its version.
// That is harmless for a redelivery whose dedup record expired, but when
// another event, with another id, was applied at that version (a
// producer's sequence fell behind what consumers had seen, as after a
// failover that lost commits), the discarded event's effect was never
// applied. Before, verify trusted the stale outcome and reported nothing.
func TestStaleEventWhoseVersionAnotherEventTookIsReported(t *testing.T) {
	t.Parallel()
	for _, separate := range []bool{false, true} {
		name := "same database"
		if separate {
			name = "separate consumer database"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, 2)
			if separate {
				f.separateConsumer()
			}
			const g = "billing"
			f.createEffects()
			first := f.publish("taken", 1)[0]
			// The producer's sequence rolls back (a failover lost the
			// commit), and the next event of the aggregate gets v1 again.
			_, err := f.env.Pool.Exec(f.ctx, `DELETE FROM `+sqlident.Qualify(f.env.Schema, "aggregate_sequences")+` WHERE aggregate_id = 'taken'`)
			require.NoError(t, err)
			second := f.publish("taken", 1)[0]
			require.EqualValues(t, 1, second.AggregateVersion)
			redelivered := f.publish("redelivered", 1)[0]
			f.markRelayed()
			f.record(g, first, "applied", 2*time.Minute)
			f.record(g, second, "stale", time.Minute)
			// Applied long ago, its record deleted by retention, then
			// delivered again: stale, and nobody else's version.
			f.setVersion(g, "redelivered", 1)
			f.record(g, redelivered, "stale", time.Minute)

			rep := f.run(verify.Config{})
			d := one(t, rep, "taken", verify.Discarded, verify.Problem, 1)
			require.Equal(t, second.ID, d.EventID)
			require.Contains(t, d.Detail, "from another event, "+first.ID)
			require.Contains(t, d.Detail, "eventline relay advance-sequences")
			require.Empty(t, findings(rep, "redelivered"), "a stale redelivery holds its own version")
			gr := group(t, rep, g)
			require.EqualValues(t, 1, gr.Discarded)
			require.EqualValues(t, 2, gr.Outcomes["stale"])
			require.False(t, rep.OK)
		})
	}
}
