package consumer

import (
	"slices"
	"testing"

	"pgregory.net/rapid"
)

// TestOffsetTrackerCommitsLowestUnfinished checks the tracker against a
// model: after any interleaving of offsets handed out (increasing, with
// gaps) and finished (in any order, some twice, some never), the offset to
// commit is the lowest unfinished one, or one past the highest handed out
// when all are finished, and it never moves backwards.
func TestOffsetTrackerCommitsLowestUnfinished(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		tr := newOffsetTracker()
		var added []int64
		finished := map[int64]bool{}
		next := rapid.Int64Range(0, 1000).Draw(rt, "start")
		last := int64(-1)
		steps := rapid.IntRange(1, 300).Draw(rt, "steps")
		for range steps {
			if len(added) == 0 || rapid.IntRange(0, 2).Draw(rt, "op") == 0 {
				next += rapid.Int64Range(1, 3).Draw(rt, "gap") // compaction leaves holes
				tr.add(next)
				added = append(added, next)
			} else {
				off := rapid.SampledFrom(added).Draw(rt, "finish")
				want := !finished[off]
				finished[off] = true
				commit, moved := tr.finish(off)
				if moved && !want {
					rt.Fatalf("finishing %d twice moved the commit", off)
				}
				require := model(added, finished)
				if commit != require {
					rt.Fatalf("commit %d, want %d (added %v, finished %v)", commit, require, added, finished)
				}
			}
			c := tr.commit()
			if c != model(added, finished) {
				rt.Fatalf("commit %d, want %d", c, model(added, finished))
			}
			if c < last {
				rt.Fatalf("commit moved back from %d to %d", last, c)
			}
			last = c
			n := 0
			for _, o := range added {
				if !finished[o] {
					n++
				}
			}
			if tr.unfinished() != n {
				rt.Fatalf("unfinished %d, want %d", tr.unfinished(), n)
			}
		}
	})
}

func model(added []int64, finished map[int64]bool) int64 {
	if len(added) == 0 {
		return -1
	}
	for _, o := range added {
		if !finished[o] {
			return o
		}
	}
	return slices.Max(added) + 1
}

func TestOffsetTrackerIgnoresUnknownOffsets(t *testing.T) {
	tr := newOffsetTracker()
	tr.add(5)
	tr.add(7)
	if c, moved := tr.finish(6); moved || c != 5 {
		t.Fatalf("unknown offset: commit %d moved %v", c, moved)
	}
	if c, moved := tr.finish(7); moved || c != 5 {
		t.Fatalf("above an unfinished offset: commit %d moved %v", c, moved)
	}
	if c, moved := tr.finish(5); !moved || c != 8 {
		t.Fatalf("all finished: commit %d moved %v", c, moved)
	}
}

// TestLaneAssignerKeepsAKeyInOneLane checks, over random sequences of
// events assigned and finished, that a key keeps its lane as long as it
// has an event in flight, that each lane's load is the number of its
// unfinished events, and that a new key goes to a least loaded lane.
func TestLaneAssignerKeepsAKeyInOneLane(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		lanes := rapid.IntRange(1, 8).Draw(rt, "lanes")
		a := newLaneAssigner(lanes)
		type ev struct {
			key  string
			lane int
		}
		var inflight []ev
		keys := []string{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k"}
		for range rapid.IntRange(1, 200).Draw(rt, "steps") {
			if len(inflight) == 0 || rapid.Bool().Draw(rt, "assign") {
				k := rapid.SampledFrom(keys).Draw(rt, "key")
				held := -1
				for _, e := range inflight {
					if e.key == k {
						held = e.lane
					}
				}
				least := slices.Min(a.load)
				l := a.assign(k)
				switch {
				case held >= 0 && l != held:
					rt.Fatalf("key %s moved from lane %d to %d with events in flight", k, held, l)
				case held < 0 && a.load[l]-1 != least:
					rt.Fatalf("new key %s went to lane %d with load %d; least is %d", k, l, a.load[l]-1, least)
				}
				inflight = append(inflight, ev{k, l})
			} else {
				i := rapid.IntRange(0, len(inflight)-1).Draw(rt, "finish")
				a.finish(inflight[i].key)
				inflight = slices.Delete(inflight, i, i+1)
			}
			load := make([]int, lanes)
			for _, e := range inflight {
				load[e.lane]++
			}
			if !slices.Equal(load, a.load) {
				rt.Fatalf("load %v, want %v", a.load, load)
			}
		}
	})
}
