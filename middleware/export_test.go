package middleware

import (
	"context"
	"sync/atomic"
)

// BatchArrivals returns how many of b's members have reached the composed
// middleware and wait there for the batch (tests wait on it instead of
// sleeping).
func BatchArrivals(b *Batch) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, s := range b.slots {
		if s.arrival != nil {
			n++
		}
	}
	return n
}

// CountUnsafeHolds replaces the pause after an unsafe-composition refusal
// with a counter (no wait), restored when the test ends.
func CountUnsafeHolds(t interface{ Cleanup(func()) }) *atomic.Int32 {
	var n atomic.Int32
	prev := holdUnsafe
	holdUnsafe = func(context.Context) { n.Add(1) }
	t.Cleanup(func() { holdUnsafe = prev })
	return &n
}

// AdmissionOrder is admissionOrder: the order a batch's admissions are
// queued in.
var AdmissionOrder = admissionOrder
