package eventline_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
)

// TestNewUpcastersPropertyNeverPanics draws registries with empty, blank
// and repeated types, versions below 1 and at the int limits, and steps
// without a Func. NewUpcasters never panics or loops on them: it either
// refuses them with an error matching ErrInvalidUpcasters or returns a
// registry whose Upcast, on events of any version, returns an event at
// the current version or an error, never panics.
func TestNewUpcastersPropertyNeverPanics(t *testing.T) {
	types := []string{"a", "b", "", " "}
	versions := []int{math.MinInt, -1, 0, 1, 2, 3, math.MaxInt - 1, math.MaxInt}
	rapid.Check(t, func(rt *rapid.T) {
		var current map[string]int
		if rapid.Bool().Draw(rt, "withCurrent") {
			current = map[string]int{}
			for range rapid.IntRange(0, 3).Draw(rt, "nCurrent") {
				current[rapid.SampledFrom(types).Draw(rt, "currentType")] = rapid.SampledFrom(versions).Draw(rt, "currentVersion")
			}
		}
		var steps []eventline.Upcaster
		for range rapid.IntRange(0, 4).Draw(rt, "nSteps") {
			s := eventline.Upcaster{Type: rapid.SampledFrom(types).Draw(rt, "stepType"), From: rapid.SampledFrom(versions).Draw(rt, "from")}
			if rapid.IntRange(0, 5).Draw(rt, "nilFunc") > 0 {
				s.Func = func(p []byte) ([]byte, error) { return p, nil }
			}
			steps = append(steps, s)
		}
		u, err := eventline.NewUpcasters(current, steps...)
		if err != nil {
			require.ErrorIs(rt, err, eventline.ErrInvalidUpcasters)
			return
		}
		e := eventline.Event{ID: "e", Type: rapid.SampledFrom(types[:2]).Draw(rt, "eventType"), AggregateType: "x", AggregateID: "1",
			SchemaVersion: rapid.SampledFrom(versions).Draw(rt, "eventVersion"), Payload: []byte(`{}`)}
		out, err := u.Upcast(e)
		if err == nil {
			if cur, ok := u.Current(e.Type); ok && e.SchemaVersion >= 1 {
				require.Equal(rt, cur, out.SchemaVersion)
			}
		}
	})
}
