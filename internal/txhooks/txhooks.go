// Package txhooks collects functions to run after a database transaction
// commits, in nested scopes that follow savepoints: hooks registered inside
// a savepoint join the enclosing transaction's hooks when the savepoint is
// released, and are dropped when it is rolled back. The middleware's
// AfterCommit and the version gate's drain and sweeper share it, so a hook
// registered by a handler runs once for every committed application,
// whichever path applied the event.
//
// A hook that panics is recovered where the hooks run ([Set.Run]): the
// panic goes to the [PanicHandler] of the context the hook was registered
// with, and the hooks after it still run. The transaction has committed by
// then; nothing can be undone, and no caller should die of it.
package txhooks

import (
	"context"
	"log/slog"
	"runtime/debug"
	"sync"
)

type key struct{}

type panicKey struct{}

// PanicHandler is told about a hook that panicked: ctx is the context the
// hook was registered with (it carries the event, for instance), value
// what it panicked with, stack where.
type PanicHandler func(ctx context.Context, value any, stack []byte)

// WithPanicHandler returns ctx carrying h: hooks registered with ctx, or a
// context derived from it, report their panics to h. Without one, a panic
// is logged through slog's default logger.
func WithPanicHandler(ctx context.Context, h PanicHandler) context.Context {
	return context.WithValue(ctx, panicKey{}, h)
}

// hook is a registered function and the context it was registered with.
type hook struct {
	ctx context.Context
	fn  func()
}

// Set holds the hooks of one transaction or savepoint.
type Set struct {
	mu     sync.Mutex
	fns    []hook
	parent *Set
}

// New returns ctx carrying a new root set, for a transaction.
func New(ctx context.Context) (context.Context, *Set) {
	s := &Set{}
	return context.WithValue(ctx, key{}, s), s
}

// Child returns ctx carrying a set for a savepoint of the transaction whose
// set ctx carries. Without one, the child is a root: Promote then drops
// nothing and keeps its hooks for Run.
func Child(ctx context.Context) (context.Context, *Set) {
	parent, _ := ctx.Value(key{}).(*Set)
	s := &Set{parent: parent}
	return context.WithValue(ctx, key{}, s), s
}

// From returns the set ctx carries, or nil.
func From(ctx context.Context) *Set {
	s, _ := ctx.Value(key{}).(*Set)
	return s
}

// Add registers fn with the set in ctx and reports whether there was one.
func Add(ctx context.Context, fn func()) bool {
	s := From(ctx)
	if s == nil {
		return false
	}
	s.mu.Lock()
	s.fns = append(s.fns, hook{ctx: ctx, fn: fn})
	s.mu.Unlock()
	return true
}

// Promote moves the hooks of a released savepoint to its parent; for a set
// without a parent it does nothing (its hooks stay for Run).
func (s *Set) Promote() {
	if s == nil || s.parent == nil {
		return
	}
	fns := s.take()
	s.parent.mu.Lock()
	s.parent.fns = append(s.parent.fns, fns...)
	s.parent.mu.Unlock()
}

// Drop forgets the hooks (the savepoint or transaction rolled back).
func (s *Set) Drop() {
	if s != nil {
		s.take()
	}
}

// Run runs the hooks once, in the order they were registered, and forgets
// them. Call it after the transaction committed. A hook that panics is
// recovered and reported (see [WithPanicHandler]); the hooks after it run.
func (s *Set) Run() {
	if s == nil {
		return
	}
	for _, h := range s.take() {
		h.run()
	}
}

// take removes the hooks from the set and returns them.
func (s *Set) take() []hook {
	s.mu.Lock()
	defer s.mu.Unlock()
	fns := s.fns
	s.fns = nil
	return fns
}

// run calls the hook, recovering and reporting a panic.
func (h hook) run() {
	defer func() {
		if v := recover(); v != nil {
			report(h.ctx, v, debug.Stack())
		}
	}()
	h.fn()
}

func report(ctx context.Context, v any, stack []byte) {
	if ph, _ := ctx.Value(panicKey{}).(PanicHandler); ph != nil {
		ph(ctx, v, stack)
		return
	}
	slog.Default().ErrorContext(ctx, "eventline: an AfterCommit hook panicked after its transaction committed; recovered, the other hooks ran",
		"panic", v, "stack", string(stack))
}
