package middleware

import (
	"errors"
	"fmt"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/versioning"
)

// Errors a handler's code and a consumer's operator meet.
var (
	// ErrNoTx is what a handler returns when its message context holds no
	// consumer transaction: it runs without the eventline middleware in
	// front of it (AddHandler and the consumer always put it there).
	ErrNoTx = errors.New("eventline: no consumer transaction in the message context; add the handler with Eventline.AddHandler (or behind MiddlewareFor)")
	// ErrInfrastructure is matched by the errors IsInfrastructure reports
	// for a database that was unavailable during the attempt.
	ErrInfrastructure = errors.New("eventline: the database is unavailable")
	// ErrNotMigrated is returned by Run (and consumer.Run) when the
	// consumer's schema lacks eventline's consumer tables: run `eventline
	// migrate up` or migrations.Up first.
	ErrNotMigrated = errors.New("eventline: consumer schema is not migrated")
	// ErrUnsafeComposition is matched by *CompositionError.
	ErrUnsafeComposition = errors.New("eventline: unsafe middleware composition")
)

// permanentError marks an error that retrying cannot fix (see Permanent).
type permanentError struct{ err error }

func (e *permanentError) Error() string { return "permanent: " + e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as permanent: retrying cannot fix it (the message is
// malformed, its payload does not decode, no handler knows its type), so
// the event is dead-lettered at its first failure, without retries. It
// returns nil for nil and err itself when it is already permanent.
func Permanent(err error) error {
	if err == nil || IsPermanent(err) {
		return err
	}
	return &permanentError{err: err}
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
	var p *permanentError
	return errors.As(err, &p) ||
		errors.Is(err, eventline.ErrInvalidEvent) ||
		errors.Is(err, versioning.ErrUnversioned) ||
		errors.Is(err, store.ErrParkConflict) ||
		permanentState(err) ||
		encodeFailure(err)
}

// panicError is the error a recovered handler panic becomes. It is not
// permanent: the transaction is rolled back and the message retried.
type panicError struct {
	value any
	stack []byte
}

// Error includes the stack.
func (e *panicError) Error() string {
	return fmt.Sprintf("eventline: handler panicked: %v\n%s", e.value, e.stack)
}

// Unwrap returns the panic value when it is an error.
func (e *panicError) Unwrap() error {
	err, _ := e.value.(error)
	return err
}
