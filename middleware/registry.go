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
	mu       sync.RWMutex
	explicit map[string]message.HandlerFunc
	learned  map[string]message.HandlerFunc
	wrapped  int
	only     message.HandlerFunc
}

func newRegistry() *registry {
	return &registry{explicit: map[string]message.HandlerFunc{}, learned: map[string]message.HandlerFunc{}}
}

// register records h, wrapped by the gate, under name, overriding
// anything learned.
func (r *registry) register(name string, h message.HandlerFunc) {
	r.mu.Lock()
	r.wrapped++
	r.only = h
	r.explicit[name] = h
	r.mu.Unlock()
}

// learn records h under name unless name is known already.
func (r *registry) learn(name string, h message.HandlerFunc) {
	if name == "" {
		return
	}
	r.mu.RLock()
	_, e := r.explicit[name]
	_, l := r.learned[name]
	r.mu.RUnlock()
	if e || l {
		return
	}
	r.mu.Lock()
	if _, ok := r.learned[name]; !ok {
		r.learned[name] = h
	}
	r.mu.Unlock()
}

// lookup returns the handler for name, or nil.
func (r *registry) lookup(name string) message.HandlerFunc {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if h, ok := r.explicit[name]; ok {
		return h
	}
	if h, ok := r.learned[name]; ok {
		return h
	}
	if r.wrapped == 1 {
		return r.only
	}
	return nil
}
