package setup

import (
	"context"
	"errors"
	"sync"
)

// Background runs an example's long-running components (a relay's Run, a
// consumer's Run) on goroutines of their own, on a context that only Stop
// cancels: each shuts down cleanly through Stop, even when the example's
// ctx ends first.
type Background struct {
	// Ctx is the example's ctx, also cancelled as soon as a component
	// returns an error: wait on it for what a failed component would never
	// do.
	Ctx context.Context

	run     context.Context
	stop    context.CancelFunc
	failed  context.CancelFunc
	wg      sync.WaitGroup
	mu      sync.Mutex
	errs    []error
	stopped bool
}

// NewBackground returns a Background for the example's ctx.
func NewBackground(ctx context.Context) *Background {
	b := &Background{}
	b.Ctx, b.failed = context.WithCancel(ctx)
	b.run, b.stop = context.WithCancel(context.WithoutCancel(ctx))
	return b
}

// Go runs fn on a goroutine of its own until Stop.
func (b *Background) Go(fn func(ctx context.Context) error) {
	b.wg.Go(func() {
		if err := fn(b.run); err != nil {
			b.mu.Lock()
			b.errs = append(b.errs, err)
			b.mu.Unlock()
			b.failed()
		}
	})
}

// Stop cancels the components' context, waits for them to return and
// returns their errors, joined. Later calls return nil, so an example can
// both stop its components when done and defer Stop for the early returns.
func (b *Background) Stop() error {
	b.stop()
	b.wg.Wait()
	b.failed()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stopped {
		return nil
	}
	b.stopped = true
	return errors.Join(b.errs...)
}
