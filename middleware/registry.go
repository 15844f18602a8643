package middleware

import (
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// registry maps Watermill handler names to the handler the gate wraps, so
// the sweeper can release a parked event through the handler it arrived on.
//
// Entries come from three places, strongest first: explicit registration
// (AddHandler, MiddlewareFor), learning at message time (the name comes from
// message.HandlerNameFromCtx, set by the Router), and, when a name is
// unknown, the only handler ever wrapped, if exactly one was.
type registry struct {
	mu sync.RWMutex
	// handlers holds each name's registered handler, or the one learned
	// under it when none is registered.
	handlers map[string]message.HandlerFunc
	wrapped  int
	only     message.HandlerFunc
}

func newRegistry() *registry {
	return &registry{handlers: map[string]message.HandlerFunc{}}
}

// register records h, wrapped by the gate, under name, overriding
// anything learned.
func (r *registry) register(name string, h message.HandlerFunc) {
	r.mu.Lock()
	r.wrapped++
	r.only = h
	r.handlers[name] = h
	r.mu.Unlock()
}

// learn records h under name unless name is known already.
func (r *registry) learn(name string, h message.HandlerFunc) {
	if name == "" {
		return
	}
	r.mu.RLock()
	_, known := r.handlers[name]
	r.mu.RUnlock()
	if known {
		return
	}
	r.mu.Lock()
	if _, ok := r.handlers[name]; !ok {
		r.handlers[name] = h
	}
	r.mu.Unlock()
}

// lookup returns the handler for name, or nil.
func (r *registry) lookup(name string) message.HandlerFunc {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if h, ok := r.handlers[name]; ok {
		return h
	}
	if r.wrapped == 1 {
		return r.only
	}
	return nil
}
