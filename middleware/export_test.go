package middleware

import (
	"context"
	"sync/atomic"
)

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
