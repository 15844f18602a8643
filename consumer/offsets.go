package consumer

import "sort"

// offsetTracker follows the offsets of one partition that were handed out
// and which of them are finished, so the offset committed to Kafka is the
// lowest one not finished yet: everything below it is finished, so a
// restart from there loses nothing, and finished events above it are only
// redelivered (and recognised by their dedup records).
//
// Offsets must be added in increasing order (gaps are allowed: compacted
// topics and transaction markers leave some). It is not safe for
// concurrent use.
type offsetTracker struct {
	pending []trackedOffset // added, in order; pending[head:] is live
	head    int
	next    int64 // one past the highest offset added; -1 before any
}

type trackedOffset struct {
	offset int64
	done   bool
}

func newOffsetTracker() *offsetTracker { return &offsetTracker{next: -1} }

// add records an offset handed out; it must be above every offset added
// before.
func (t *offsetTracker) add(offset int64) {
	t.pending = append(t.pending, trackedOffset{offset: offset})
	t.next = offset + 1
}

// finish marks an added offset finished and returns the offset to commit
// and whether it moved. Finishing an unknown or finished offset changes
// nothing.
func (t *offsetTracker) finish(offset int64) (commit int64, moved bool) {
	live := t.pending[t.head:]
	i := sort.Search(len(live), func(i int) bool { return live[i].offset >= offset })
	if i == len(live) || live[i].offset != offset || live[i].done {
		return t.commit(), false
	}
	live[i].done = true
	if i != 0 {
		return t.commit(), false
	}
	for t.head < len(t.pending) && t.pending[t.head].done {
		t.head++
	}
	// Drop the finished prefix once it outweighs what is live.
	if t.head > 64 && t.head*2 > len(t.pending) {
		t.pending = append(t.pending[:0], t.pending[t.head:]...)
		t.head = 0
	}
	return t.commit(), true
}

// commit is the offset to commit: the lowest added offset not finished,
// or one past the highest added when all are finished; -1 before any.
func (t *offsetTracker) commit() int64 {
	if t.head < len(t.pending) {
		return t.pending[t.head].offset
	}
	return t.next
}

// unfinished is the number of added offsets not finished.
func (t *offsetTracker) unfinished() int {
	n := 0
	for _, p := range t.pending[t.head:] {
		if !p.done {
			n++
		}
	}
	return n
}
