package eventline

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// ErrUnknownSchemaVersion is matched by *UnknownSchemaVersionError: an event
// whose payload schema version this consumer cannot turn into the version
// its handler is written for.
var ErrUnknownSchemaVersion = errors.New("eventline: unknown payload schema version")

// ErrUpcast is matched by *UpcastError: an upcaster failed on an event's
// payload.
var ErrUpcast = errors.New("eventline: upcaster failed")

// ErrInvalidUpcasters is matched by the errors [NewUpcasters] returns for a
// registry that is incomplete or inconsistent.
var ErrInvalidUpcasters = errors.New("eventline: invalid upcasters")

// Upcaster rewrites the raw payload of one event type from schema version
// From to From+1.
type Upcaster struct {
	// Type is the event type, e.g. "order.created". Required.
	Type string
	// From is the schema version Func reads; Func returns the payload as
	// version From+1. At least 1.
	From int
	// Func rewrites the payload. It must not modify its argument, and it
	// must depend on nothing but the payload: an error it returns is
	// permanent (retrying cannot change it), so the event is dead-lettered.
	// Required.
	Func func(payload []byte) ([]byte, error)
}

// Upcasters is a registry of payload upcasters: for each event type it
// knows, the current schema version (the one handlers are written for) and
// a chain of steps that turns every older version it accepts into the
// current one.
//
// Upcast is applied when an event is handled, not when it is received, so
// old outbox rows, old Kafka records, parked events released later and
// replayed dead letters all reach the handler as the current version.
// Event types the registry does not know pass through unchanged, at any
// version.
//
// An Upcasters is immutable and safe for concurrent use. A nil *Upcasters
// is an empty registry.
type Upcasters struct {
	chains map[string]upcastChain
}

type upcastChain struct {
	oldest, current int
	// steps[i] upcasts version oldest+i.
	steps []func([]byte) ([]byte, error)
}

// NewUpcasters returns a registry of the given steps.
//
// current maps event types to the schema version their handlers are
// written for (nil is fine). A type with steps but no entry in current is
// current at its highest step's From+1; a type in current without steps
// accepts only that version, so a producer that starts writing a newer one
// is caught rather than mis-decoded.
//
// For each type, the steps must form one chain without holes, from the
// oldest version accepted up to the current one: From = n, n+1, …,
// current-1. A missing, duplicate or out-of-range step is an error
// (matching ErrInvalidUpcasters) that names the type and the versions.
func NewUpcasters(current map[string]int, steps ...Upcaster) (*Upcasters, error) {
	byType := map[string]map[int]func([]byte) ([]byte, error){}
	for i, s := range steps {
		switch {
		case strings.TrimSpace(s.Type) == "":
			return nil, fmt.Errorf("%w: step %d: Type is empty: name the event type the upcaster rewrites", ErrInvalidUpcasters, i)
		case s.From < 1:
			return nil, fmt.Errorf("%w: %s: From is %d: schema versions start at 1", ErrInvalidUpcasters, s.Type, s.From)
		case s.Func == nil:
			return nil, fmt.Errorf("%w: %s: the upcaster from version %d has no Func", ErrInvalidUpcasters, s.Type, s.From)
		}
		m := byType[s.Type]
		if m == nil {
			m = map[int]func([]byte) ([]byte, error){}
			byType[s.Type] = m
		}
		if m[s.From] != nil {
			return nil, fmt.Errorf("%w: %s: two upcasters from version %d: keep one", ErrInvalidUpcasters, s.Type, s.From)
		}
		m[s.From] = s.Func
	}
	u := &Upcasters{chains: map[string]upcastChain{}}
	for t, v := range current {
		if strings.TrimSpace(t) == "" {
			return nil, fmt.Errorf("%w: current version declared for an empty event type", ErrInvalidUpcasters)
		}
		if v < 1 {
			return nil, fmt.Errorf("%w: %s: current version %d: schema versions start at 1", ErrInvalidUpcasters, t, v)
		}
		if byType[t] == nil {
			u.chains[t] = upcastChain{oldest: v, current: v}
		}
	}
	for t, m := range byType {
		froms := slices.Sorted(maps.Keys(m))
		oldest, highest := froms[0], froms[len(froms)-1]
		cur, declared := current[t]
		if !declared {
			cur = highest + 1
		}
		if highest >= cur {
			return nil, fmt.Errorf("%w: %s: an upcaster from version %d goes past the current version %d: raise the current version or drop the step",
				ErrInvalidUpcasters, t, highest, cur)
		}
		c := upcastChain{oldest: oldest, current: cur}
		for v := oldest; v < cur; v++ {
			fn := m[v]
			if fn == nil {
				return nil, fmt.Errorf("%w: %s: no upcaster from version %d to %d, so versions %d..%d cannot reach the current version %d: add that step",
					ErrInvalidUpcasters, t, v, v+1, oldest, v, cur)
			}
			c.steps = append(c.steps, fn)
		}
		u.chains[t] = c
	}
	return u, nil
}

// Current returns the schema version handlers of eventType are written
// for, and whether the registry knows the type.
func (u *Upcasters) Current(eventType string) (int, bool) {
	if u == nil {
		return 0, false
	}
	c, ok := u.chains[eventType]
	return c.current, ok
}

// Upcast returns e with its payload rewritten to the current schema
// version of its type and SchemaVersion set to it. An event of a type the
// registry does not know, or already at the current version, is returned
// unchanged (a SchemaVersion of 0 counts as 1).
//
// It returns an *UnknownSchemaVersionError when e's version is newer than
// the current one or older than the oldest the chain accepts, and an
// *UpcastError when a step fails or, for a JSON event, returns something
// that is not JSON. Both match ErrInvalidEvent: retrying cannot help, so
// consumers dead-letter the event with the error as the reason.
func (u *Upcasters) Upcast(e Event) (Event, error) {
	if u == nil {
		return e, nil
	}
	c, ok := u.chains[e.Type]
	if !ok {
		return e, nil
	}
	v := max(e.SchemaVersion, 1)
	switch {
	case v == c.current:
		return e, nil
	case v > c.current || v < c.oldest:
		return e, &UnknownSchemaVersionError{EventID: e.ID, Type: e.Type, Version: v, Current: c.current, Oldest: c.oldest}
	}
	payload := e.Payload
	for ; v < c.current; v++ {
		out, err := c.steps[v-c.oldest](payload)
		if err == nil && e.IsJSON() && !json.Valid(out) {
			err = errors.New("the result is not valid JSON")
		}
		if err != nil {
			return e, &UpcastError{EventID: e.ID, Type: e.Type, From: v, Err: err}
		}
		payload = out
	}
	e.Payload, e.SchemaVersion = payload, c.current
	return e, nil
}

// UnknownSchemaVersionError rejects an event whose payload schema version
// the registry cannot turn into the current one.
type UnknownSchemaVersionError struct {
	EventID string
	Type    string
	// Version is the event's schema version.
	Version int
	// Current is the version handlers are written for; Oldest the oldest
	// the upcaster chain accepts.
	Current, Oldest int
}

// Error implements error; the message says what to deploy.
func (e *UnknownSchemaVersionError) Error() string {
	if e.Version > e.Current {
		return fmt.Sprintf("eventline: event %s (%s) has payload schema version %d, newer than this consumer's current version %d: "+
			"deploy a consumer whose handler reads version %d (with an upcaster from %d), then replay the dead letter",
			e.EventID, e.Type, e.Version, e.Current, e.Version, e.Current)
	}
	return fmt.Sprintf("eventline: event %s (%s) has payload schema version %d, older than the oldest version %d this consumer upcasts: "+
		"add an upcaster from version %d, then replay the dead letter",
		e.EventID, e.Type, e.Version, e.Oldest, e.Version)
}

// Unwrap lets errors.Is match ErrUnknownSchemaVersion and ErrInvalidEvent.
func (e *UnknownSchemaVersionError) Unwrap() []error {
	return []error{ErrUnknownSchemaVersion, ErrInvalidEvent}
}

// UpcastError reports an upcaster step that failed on an event's payload.
type UpcastError struct {
	EventID string
	Type    string
	// From is the version the failing step reads.
	From int
	// Err is what the step returned.
	Err error
}

// Error implements error.
func (e *UpcastError) Error() string {
	return fmt.Sprintf("eventline: event %s (%s): upcaster from schema version %d to %d failed: %v: fix the upcaster, then replay the dead letter",
		e.EventID, e.Type, e.From, e.From+1, e.Err)
}

// Unwrap lets errors.Is match ErrUpcast, ErrInvalidEvent and the step's
// own error.
func (e *UpcastError) Unwrap() []error { return []error{ErrUpcast, ErrInvalidEvent, e.Err} }
