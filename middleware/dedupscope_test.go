package middleware_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/migrations"
)

// A record that carries a genuine event's id for another aggregate, and
// arrives first, is a different event of its own aggregate, gated on its
// own version: both are applied, one at a time and in one batch. Within
// one aggregate the id still conflicts: a second event under a recorded id
// is refused. Before: the genuine event was refused as an id conflict
// (dead-lettered), and every later version of its aggregate parked behind
// it.
func TestAnIDReusedByAnotherAggregateCostsTheGenuineEventNothing(t *testing.T) {
	t.Parallel()
	for _, batched := range []bool{false, true} {
		name := map[bool]string{false: "one at a time", true: "in a batch"}[batched]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, middleware.Config{})
			a1, a2 := consumertest.Event("a", 1), consumertest.Event("a", 2)
			reused := consumertest.Event("h", 1)
			reused.ID = a1.ID
			msgs := []*message.Message{consumertest.Message(t, reused), consumertest.Message(t, a1), consumertest.Message(t, a2)}
			var errs []error
			if batched {
				errs = deliverBatch(f.handler, msgs...)
			} else {
				for _, m := range msgs {
					errs = append(errs, f.deliver(t, m))
				}
			}
			for i, err := range errs {
				require.NoError(t, err, "message %d", i)
			}
			require.Equal(t, []int64{1}, f.versions(t, "h"), "the reused id is an event of h")
			require.Equal(t, []int64{1, 2}, f.versions(t, "a"), "the genuine event and its successor")
			require.Zero(t, f.metric(t, "eventline_consumer_events_refused_total"))

			sameAggregate := consumertest.Event("a", 3)
			sameAggregate.ID = a2.ID
			err := f.deliver(t, consumertest.Message(t, sameAggregate))
			require.ErrorIs(t, err, dedup.ErrIDConflict, "within one aggregate the id still conflicts")
			require.Equal(t, []int64{1, 2}, f.versions(t, "a"))
		})
	}
}

// A consumer schema whose dedup records are keyed by event id alone (a
// pre-release eventline's, before 007_dedup_scope) is not migrated: the
// middleware would deduplicate by the old key.
func TestCheckMigratedWantsDedupRecordsKeyedByAggregate(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	cfg := migrations.Config{Schema: env.Schema}
	el, err := middleware.New(env.Pool, middleware.Config{Group: "g", Schema: env.Schema, Logger: quiet()})
	require.NoError(t, err)
	require.NoError(t, el.CheckMigrated(ctx))
	rekey := func(key string) {
		_, err := env.Pool.Exec(ctx, `ALTER TABLE `+sqlident.Qualify(cfg.Schema, "processed_events")+` DROP CONSTRAINT processed_events_pkey, ADD PRIMARY KEY (`+key+`)`)
		require.NoError(t, err)
	}
	rekey("consumer_group, event_id")
	err = el.CheckMigrated(ctx)
	require.ErrorIs(t, err, middleware.ErrNotMigrated)
	require.ErrorContains(t, err, "007_dedup_scope")
	rekey("consumer_group, event_id, aggregate_type, aggregate_id")
	require.NoError(t, el.CheckMigrated(ctx))
}
