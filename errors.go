package eventline

import (
	"errors"
	"fmt"
)

// ErrInvalidEvent is matched (with errors.Is) by every error that rejects an
// event for its content: missing or malformed fields on publish, and
// malformed metadata on decode. Retrying such an event cannot succeed.
var ErrInvalidEvent = errors.New("eventline: invalid event")

// InvalidEventError says which field of an event is wrong and why.
type InvalidEventError struct {
	// Field is the envelope name of the field, e.g. "aggregate_id".
	Field string
	// Value is the offending value, when showing it helps.
	Value string
	// Reason says what is wrong with it.
	Reason string
}

func (e *InvalidEventError) Error() string {
	if e.Value != "" {
		return fmt.Sprintf("eventline: invalid event: %s %q: %s", e.Field, e.Value, e.Reason)
	}
	return fmt.Sprintf("eventline: invalid event: %s: %s", e.Field, e.Reason)
}

// Unwrap lets errors.Is(err, ErrInvalidEvent) match.
func (e *InvalidEventError) Unwrap() error { return ErrInvalidEvent }
