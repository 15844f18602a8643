package middleware

import (
	"errors"
	"fmt"

	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/versioning"
)

// PermanentError marks an error that retrying cannot fix: the message is
// malformed, its payload does not decode, no handler knows its type. Retry
// middleware configured with [ShouldRetry] gives up on it at once, so it is
// dead-lettered on its first failure.
type PermanentError struct {
	// Err is the underlying error.
	Err error
}

// Error implements error.
func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent marks err as permanent (see PermanentError). It returns nil for
// nil and err itself when it is already permanent.
func Permanent(err error) error {
	if err == nil || IsPermanent(err) {
		return err
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err is permanent: marked with Permanent, or
// one of the errors that can never succeed on retry: an invalid event
// (eventline.ErrInvalidEvent), an unversioned event under
// RejectUnversioned, two events claiming one aggregate version, a
// PostgreSQL error of SQLSTATE class 22 (data exception: a NUL byte or
// invalid UTF-8 in text, a value out of range…) or 54 (program limit
// exceeded: a key too large for its index…), or pgx's refusal to encode a
// statement argument for its column (a number out of the column's range,
// caught before PostgreSQL sees it), which the same data raises every
// time.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p) ||
		errors.Is(err, eventline.ErrInvalidEvent) ||
		errors.Is(err, versioning.ErrUnversioned) ||
		errors.Is(err, versioning.ErrParkConflict) ||
		permanentState(err) ||
		encodeFailure(err)
}

// ShouldRetry is a ShouldRetry function for Watermill's Retry middleware
// that skips retries of permanent errors:
//
//	wmiddleware.Retry{MaxRetries: 5, ResetContextOnRetry: true, ShouldRetry: middleware.ShouldRetry}
//
// Prefer eventline's own [Retry]: Watermill's spends its budget on a
// database outage (then the event is dead-lettered although nothing is
// wrong with it) and waits about four times the configured intervals.
func ShouldRetry(p wmiddleware.RetryParams) bool { return !IsPermanent(p.Err) }

// PanicError is the error a recovered handler panic becomes. It is not
// permanent: the transaction is rolled back and the message retried.
type PanicError struct {
	// Value is what the handler panicked with.
	Value any
	// Stack is the panicking goroutine's stack.
	Stack []byte
}

// Error implements error; the message includes the stack.
func (e *PanicError) Error() string {
	return fmt.Sprintf("eventline: handler panicked: %v\n%s", e.Value, e.Stack)
}

// Unwrap returns the panic value when it is an error.
func (e *PanicError) Unwrap() error {
	err, _ := e.Value.(error)
	return err
}

// ErrNoTx is returned by Dedup and Gate when the message context holds no
// consumer transaction.
var ErrNoTx = errors.New("eventline: no consumer transaction in the message context; put middleware.Tx outside Dedup and Gate, or use middleware.New")
