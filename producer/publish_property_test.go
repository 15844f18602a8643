package producer_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// modelAgg is what the model knows of one aggregate.
type modelAgg struct {
	last    int64
	topic   string     // "" until recorded
	written [][2]int64 // (version, previous version) of every committed event
}

// callStep is one event of a generated call.
type callStep struct {
	agg      string
	topic    string
	supplied bool
	offset   int64 // supplied version = the version it should have + offset
}

// TestPublishTxVersionRulesProperty publishes random calls (mixes of
// supplied and assigned versions, right, stale and skipping ones, two
// topics, older aggregates without a recorded topic, with and without
// gaps allowed, committed or rolled back) and checks each outcome against
// a model of the rules: which error, or which versions and previous
// versions; and that the outbox holds exactly the committed events, each
// recording the version it follows.
func TestPublishTxVersionRulesProperty(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	strict := newProducerWith(t, env, producer.Config{DefaultTopic: "t1"})
	gaps := newProducerWith(t, env, producer.Config{DefaultTopic: "t1", AllowVersionGaps: true})
	ctx := context.Background()
	run := 0
	rapid.Check(t, func(rt *rapid.T) {
		run++
		ids := []string{fmt.Sprintf("r%d-a", run), fmt.Sprintf("r%d-b", run), fmt.Sprintf("r%d-c", run)}
		model := map[string]*modelAgg{}
		for _, id := range ids {
			model[id] = &modelAgg{}
			if rapid.IntRange(0, 3).Draw(rt, "legacy") == 0 {
				// A sequence row from before topics were recorded.
				last := int64(rapid.IntRange(1, 5).Draw(rt, "legacyVersion"))
				_, err := env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "aggregate_sequences")+
					` (aggregate_type, aggregate_id, version) VALUES ('order', $1, $2)`, id, last)
				require.NoError(rt, err)
				model[id].last = last
			}
		}
		for call := range rapid.IntRange(1, 8).Draw(rt, "calls") {
			allowGaps := rapid.Bool().Draw(rt, "gaps")
			steps := rapid.SliceOfN(rapid.Custom(func(rt *rapid.T) callStep {
				s := callStep{agg: rapid.SampledFrom(ids).Draw(rt, "agg"), topic: "t1"}
				if rapid.IntRange(0, 9).Draw(rt, "otherTopic") == 0 {
					s.topic = "t2"
				}
				if s.supplied = rapid.IntRange(0, 2).Draw(rt, "supplied") == 0; s.supplied {
					s.offset = rapid.SampledFrom([]int64{-1, 0, 0, 0, 1, 3}).Draw(rt, "offset")
				}
				return s
			}), 1, 4).Draw(rt, "steps")
			rollback := rapid.IntRange(0, 4).Draw(rt, "rollback") == 0

			events, want, wantErr := predict(model, steps, allowGaps)
			rt.Logf("call %d gaps=%v rollback=%v steps=%v want=%v wantErr=%v", call, allowGaps, rollback, steps, want, wantErr)
			p := strict
			if allowGaps {
				p = gaps
			}
			var written []eventline.Event
			err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
				var err error
				written, err = p.PublishTxReturning(ctx, tx, events...)
				if err != nil {
					requireUsable(rt, tx)
					return err
				}
				if rollback {
					return errRollback
				}
				return nil
			})
			if wantErr != nil {
				require.ErrorIs(rt, err, wantErr, "call %d: %v", call, steps)
				continue
			}
			if rollback {
				require.ErrorIs(rt, err, errRollback)
			} else {
				require.NoError(rt, err, "call %d: %v", call, steps)
			}
			for i, e := range written {
				w := want[i]
				if w[1] == 0 && w[0] > 1 {
					w[1] = eventline.NoPreviousVersion // follows version 0 (the record says "0")
				}
				require.Equal(rt, w, [2]int64{e.AggregateVersion, e.PreviousVersion}, "call %d event %d: %v", call, i, steps)
			}
			if rollback {
				continue
			}
			// Commit the model.
			for i, s := range steps {
				m := model[s.agg]
				m.last, m.topic = want[i][0], s.topic
				m.written = append(m.written, want[i])
			}
		}
		for _, id := range ids {
			require.Equal(rt, model[id].written, storedVersions(rt, env, id), "aggregate %s", id)
			v, _, ok := sequence(rt, env, "order", id)
			require.Equal(rt, model[id].last, v, "aggregate %s", id)
			require.Equal(rt, model[id].last != 0, ok)
		}
	})
}

// predict returns the call's events and, per the rules, either the
// (version, previous version) each gets or the error the call fails with.
func predict(model map[string]*modelAgg, steps []callStep, allowGaps bool) ([]eventline.Event, [][2]int64, error) {
	type agg struct {
		topic      string
		count      int64
		lead       int64
		firstIndex int   // index of the first event
		supIndex   int   // index of the first supplied event
		firstSup   int64 // 0: none
		last       int64 // running version, when known without the database
	}
	aggs := map[string]*agg{}
	events := make([]eventline.Event, len(steps))
	var clientErr error
	for i, s := range steps {
		m := model[s.agg]
		a := aggs[s.agg]
		if a == nil {
			a = &agg{topic: s.topic, firstIndex: i}
			aggs[s.agg] = a
		}
		// The version this event should have, from the model.
		should := m.last + a.count + 1
		e := eventline.Event{Type: "order.updated", AggregateType: "order", AggregateID: s.agg, Topic: s.topic, Payload: []byte(`{}`)}
		if s.supplied {
			e.AggregateVersion = max(should+s.offset, 1)
		}
		events[i] = e
		if clientErr != nil {
			continue
		}
		switch {
		case s.topic != a.topic:
			clientErr = producer.ErrTopicConflict
		case !s.supplied && a.firstSup != 0:
			a.last++
		case !s.supplied:
			a.lead++
		case a.firstSup != 0 && e.AggregateVersion <= a.last:
			clientErr = eventline.ErrInvalidEvent
		case a.firstSup != 0 && e.AggregateVersion != a.last+1 && !allowGaps:
			clientErr = producer.ErrVersionGap
		case a.firstSup != 0:
			a.last = e.AggregateVersion
		default:
			a.firstSup, a.supIndex, a.last = e.AggregateVersion, i, e.AggregateVersion
		}
		a.count++
	}
	if clientErr != nil {
		return events, nil, clientErr
	}
	// The database's checks: the first conflicting aggregate, by the index
	// of the event that conflicts.
	var dbErr error
	errIndex := len(steps)
	for id, a := range aggs {
		m := model[id]
		var err error
		index := a.supIndex
		switch {
		case m.topic != "" && m.topic != a.topic:
			err, index = producer.ErrTopicConflict, a.firstIndex
		case a.firstSup == 0:
		case m.last+a.lead >= a.firstSup:
			err = producer.ErrVersionConflict
		case !allowGaps && m.last+a.lead+1 != a.firstSup:
			err = producer.ErrVersionGap
		}
		if err != nil && index < errIndex {
			dbErr, errIndex = err, index
		}
	}
	if dbErr != nil {
		return events, nil, dbErr
	}
	want := make([][2]int64, len(steps))
	running := map[string]int64{}
	for id := range aggs {
		running[id] = model[id].last
	}
	for i, e := range events {
		prev := running[e.AggregateID]
		v := e.AggregateVersion
		if v == 0 {
			v = prev + 1
		}
		want[i] = [2]int64{v, prev}
		running[e.AggregateID] = v
	}
	return events, want, nil
}

// storedVersions returns (version, previous version) of an order's events
// in the outbox, in outbox order.
func storedVersions(t require.TestingT, env pgtest.Env, id string) [][2]int64 {
	var out [][2]int64
	for s := 0; s < env.Shards; s++ {
		rows, err := env.Pool.Query(context.Background(), `SELECT (payload->'metadata'->>'aggregate_version')::bigint,
			coalesce((payload->'metadata'->>'aggregate_previous_version')::bigint, (payload->'metadata'->>'aggregate_version')::bigint - 1)
			FROM `+sqlident.Qualify(env.Schema, outbox.Table(s))+` WHERE payload->'metadata'->>'aggregate_id' = $1 ORDER BY transaction_id, "offset"`, id)
		require.NoError(t, err)
		got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) ([2]int64, error) {
			var vp [2]int64
			return vp, r.Scan(&vp[0], &vp[1])
		})
		require.NoError(t, err)
		out = append(out, got...)
	}
	return out
}
