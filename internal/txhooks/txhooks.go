// Package txhooks collects functions to run after a database transaction
// commits, in nested scopes that follow savepoints: hooks registered inside
// a savepoint join the enclosing transaction's hooks when the savepoint is
// released, and are dropped when it is rolled back. The middleware's
// AfterCommit and the version gate's drain and sweeper share it, so a hook
// registered by a handler runs once for every committed application,
// whichever path applied the event.
package txhooks

import (
	"context"
	"sync"
)

type key struct{}

// Set holds the hooks of one transaction or savepoint.
type Set struct {
	mu     sync.Mutex
	fns    []func()
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
	s.fns = append(s.fns, fn)
	s.mu.Unlock()
	return true
}

// Promote moves the hooks of a released savepoint to its parent; for a set
// without a parent it does nothing (its hooks stay for Run).
func (s *Set) Promote() {
	if s == nil || s.parent == nil {
		return
	}
	s.mu.Lock()
	fns := s.fns
	s.fns = nil
	s.mu.Unlock()
	s.parent.mu.Lock()
	s.parent.fns = append(s.parent.fns, fns...)
	s.parent.mu.Unlock()
}

// Drop forgets the hooks (the savepoint or transaction rolled back).
func (s *Set) Drop() {
	if s == nil {
		return
	}
	s.mu.Lock()
	s.fns = nil
	s.mu.Unlock()
}

// Run runs the hooks once, in the order they were registered, and forgets
// them. Call it after the transaction committed.
func (s *Set) Run() {
	if s == nil {
		return
	}
	s.mu.Lock()
	fns := s.fns
	s.fns = nil
	s.mu.Unlock()
	for _, fn := range fns {
		fn()
	}
}
