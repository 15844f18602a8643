package eventlinetest

import (
	"fmt"
	"math/rand/v2"
	"slices"
)

// profile is what a trial tests; a seed's low byte holds it.
type profile uint8

const (
	profileDuplicates profile = iota + 1
	profileReordering
	profileWithholding
	profileCrashes
	profileRebalances
	profileHandlerErrors
	profileMixed
	profileAll
	// profileBatches comes last so that the seeds of the other profiles
	// keep their numbers.
	profileBatches
)

// faultClasses are the fault classes, named, with the profiles that test
// each alone, in the order the first trials run them.
var faultClasses = []struct {
	id    profile
	fault Fault
	name  string
}{
	{profileDuplicates, Duplicates, "duplicates"}, {profileReordering, Reordering, "reordering"},
	{profileWithholding, Withholding, "withholding"}, {profileCrashes, Crashes, "crashes"}, {profileRebalances, Rebalances, "rebalances"},
	{profileHandlerErrors, HandlerErrors, "handler errors"}, {profileBatches, Batches, "batches"},
}

func (p profile) String() string {
	for _, s := range faultClasses {
		if s.id == p {
			return s.name
		}
	}
	if p == profileAll {
		return "every fault class at once"
	}
	return "a random mix of faults"
}

// fault is one injected fault. Which fields matter depends on kind.
type fault struct {
	kind Fault
	// event is the event a Duplicates, Withholding or HandlerErrors fault
	// is about.
	event int
	// after is, for Duplicates, how many records after the original the
	// copy is; for Withholding, the later event of the same aggregate the
	// withheld one is released after; for Crashes and Rebalances, the
	// delivery the fault happens before.
	after int
	// partition is the partition a Rebalances fault moves.
	partition int
	// size is, for Batches, how many records the batch takes at most.
	size int
}

// schedule is one trial's delivery plan. It is a pure function of the seed
// (and the case); shrinking removes faults from it.
type schedule struct {
	seed    uint64
	profile profile
	// partitions is the partition count; partOf maps aggregates to them.
	partitions int
	partOf     []int
	// reverse drains partitions last to first instead of interleaving
	// them at random.
	reverse bool
	// commitEvery: after a delivery, offsets are committed with
	// probability 1/commitEvery.
	commitEvery int
	// sweepEvery: after a delivery, a sweeper pass runs with probability
	// 1/sweepEvery.
	sweepEvery int
	faults     []fault
}

// rng returns the random source a schedule's execution draws from (the
// interleaving, offset commits, sweeper passes).
func (s schedule) rng() *rand.Rand { return rand.New(rand.NewPCG(s.seed, 0x6576656e746c696e)) }

// schedule draws a trial's schedule from seed.
func (k *kit) schedule(seed uint64) schedule {
	rng := rand.New(rand.NewPCG(seed, 0x7363686564756c65))
	p := profile(seed & 0xff)
	if p < profileDuplicates || p > profileBatches {
		p = profileMixed
	}
	has := func(f Fault) bool {
		switch {
		case k.Faults&f == 0:
			return false
		case p == profileAll:
			return true
		case p == profileMixed:
			return rng.IntN(2) == 0
		}
		for _, s := range faultClasses {
			if s.id == p {
				return s.fault == f
			}
		}
		return false
	}
	nAggs, n := len(k.aggs), len(k.Events)
	s := schedule{seed: seed, profile: p, commitEvery: 1 + rng.IntN(3), sweepEvery: 4 + rng.IntN(8)}

	// Partitions: one, unless aggregates are reordered; then up to one
	// per aggregate, or exactly one per aggregate drained last to first.
	s.partitions = 1
	if has(Reordering) && nAggs > 1 {
		s.partitions = 2 + rng.IntN(nAggs-1)
		s.reverse = p == profileReordering || rng.IntN(3) == 0
		if s.reverse {
			s.partitions = nAggs
		}
	}
	s.partOf = make([]int, nAggs)
	for a := range s.partOf {
		if s.reverse {
			s.partOf[a] = a
		} else {
			s.partOf[a] = rng.IntN(s.partitions)
		}
	}

	// Per-event faults: every event in a single-class profile, a random
	// third of them in a mix.
	pick := func() bool { return (p != profileMixed && p != profileAll) || rng.IntN(3) == 0 }
	dup, wh, he := has(Duplicates), has(Withholding), has(HandlerErrors)
	for i := range n {
		if dup && pick() {
			s.faults = append(s.faults, fault{kind: Duplicates, event: i, after: rng.IntN(min(n, 6))})
		}
		if he && pick() {
			s.faults = append(s.faults, fault{kind: HandlerErrors, event: i})
		}
	}
	if wh {
		// One withheld version per aggregate that has a successor.
		for _, evs := range k.aggs {
			if len(evs) < 2 || ((p == profileMixed || p == profileAll) && rng.IntN(2) == 0) {
				continue
			}
			j := rng.IntN(len(evs) - 1)
			later := j + 1 + rng.IntN(len(evs)-j-1)
			s.faults = append(s.faults, fault{kind: Withholding, event: evs[j], after: evs[later]})
		}
	}
	records := n + countKind(s.faults, Duplicates)
	if has(Crashes) && records > 1 {
		if p == profileCrashes {
			s.commitEvery = 3 + rng.IntN(4)
		}
		for range 1 + rng.IntN(2) {
			s.faults = append(s.faults, fault{kind: Crashes, after: 1 + rng.IntN(records-1)})
		}
	}
	if has(Rebalances) && records > 1 {
		for range 1 + rng.IntN(2) {
			s.faults = append(s.faults, fault{kind: Rebalances, after: 1 + rng.IntN(records-1), partition: rng.IntN(s.partitions)})
		}
	}
	// Drawn last, so that a schedule without batches is the one its seed
	// drew before they existed.
	if has(Batches) {
		// A batch starts at a delivery and takes up to size records of the
		// partition being read: at every delivery in the schedule that
		// tests batches alone, at a quarter of them in a mix.
		for d := 1; d <= records; d++ {
			if p == profileBatches || rng.IntN(4) == 0 {
				s.faults = append(s.faults, fault{kind: Batches, after: d, size: 2 + rng.IntN(5)})
			}
		}
		for i := range n {
			if pick() {
				s.faults = append(s.faults, fault{kind: hookPanics, event: i})
			}
		}
	}
	return s
}

func countKind(fs []fault, kind Fault) int {
	n := 0
	for _, f := range fs {
		if f.kind == kind {
			n++
		}
	}
	return n
}

// stops returns s's faults of the given kinds (Crashes, Rebalances,
// Batches) in the order of the deliveries they come before.
func (s schedule) stops(kinds Fault) []fault {
	var out []fault
	for _, f := range s.faults {
		if f.kind&kinds != 0 {
			out = append(out, f)
		}
	}
	slices.SortStableFunc(out, func(a, b fault) int { return a.after - b.after })
	return out
}

// without returns s without its faults i to j-1.
func (s schedule) without(i, j int) schedule {
	s.faults = slices.Delete(slices.Clone(s.faults), i, j)
	return s
}

// logs returns each partition's records (event indices) in the order they
// sit on it: each aggregate's events in version order, withheld versions
// moved after the event they are released after, copies inserted after
// their originals.
func (k *kit) logs(s schedule) [][]int {
	logs := make([][]int, s.partitions)
	for i := range k.Events {
		p := s.partOf[k.aggOf[i]]
		logs[p] = append(logs[p], i)
	}
	for _, f := range s.faults {
		if f.kind != Withholding {
			continue
		}
		p := s.partOf[k.aggOf[f.event]]
		log := logs[p]
		from := slices.Index(log, f.event)
		log = slices.Delete(log, from, from+1)
		to := slices.Index(log, f.after)
		logs[p] = slices.Insert(log, to+1, f.event)
	}
	for _, f := range s.faults {
		if f.kind != Duplicates {
			continue
		}
		p := s.partOf[k.aggOf[f.event]]
		at := min(slices.Index(logs[p], f.event)+1+f.after, len(logs[p]))
		logs[p] = slices.Insert(logs[p], at, f.event)
	}
	return logs
}

// describe says what a fault does, in the words of a report.
func (k *kit) describe(f fault) string {
	switch f.kind {
	case Duplicates:
		if f.after == 0 {
			return fmt.Sprintf("%s is delivered twice in a row", k.label(f.event))
		}
		return fmt.Sprintf("%s is delivered again %d records later", k.label(f.event), f.after)
	case Withholding:
		return fmt.Sprintf("%s is withheld until after v%d", k.label(f.event), k.Events[f.after].AggregateVersion)
	case Crashes:
		return fmt.Sprintf("the consumer crashes before delivery %d, after its last commit but before committing offsets; a new instance reads again from the committed offsets", f.after)
	case Rebalances:
		return fmt.Sprintf("before delivery %d, partition %d moves to a new consumer instance while the old one is still handling its event", f.after, f.partition)
	case HandlerErrors:
		return fmt.Sprintf("the handler's first run for %s fails after it ran, and the event is retried", k.label(f.event))
	case Batches:
		return fmt.Sprintf("from delivery %d, up to %d records of the partition are delivered as one batch (one transaction)", f.after, f.size)
	case hookPanics:
		return fmt.Sprintf("an AfterCommit hook registered with %s's first committed run panics", k.label(f.event))
	}
	return fmt.Sprintf("fault %d", f.kind)
}

// tests says what a profile tests, with the case's fault classes.
func (k *kit) tests(p profile) string {
	switch p {
	case profileAll:
		return "all of " + k.Faults.String() + " at once"
	case profileMixed:
		return "a random mix of " + k.Faults.String()
	}
	return p.String()
}

// layout describes a schedule's partitions.
func (k *kit) layout(s schedule) string {
	switch {
	case s.partitions == 1:
		return "one partition, events in the order published"
	case s.reverse:
		return fmt.Sprintf("%d partitions, one per aggregate, drained last aggregate first", s.partitions)
	}
	return fmt.Sprintf("%d partitions, aggregates assigned at random, interleaved at random", s.partitions)
}
