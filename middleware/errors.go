package middleware

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgerr"
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

// infraError is the eventline middleware's verdict that the database, not
// the event or the handler, failed (see IsInfrastructure). It matches
// ErrInfrastructure.
type infraError struct {
	op  string // what eventline was doing: "begin", "handler", "commit"…
	err error
}

func (e *infraError) Error() string {
	return fmt.Sprintf("eventline: database unavailable during %s (the event is kept and retried when it answers again): %v", e.op, e.err)
}

func (e *infraError) Unwrap() []error { return []error{e.err, ErrInfrastructure} }

func (e *infraError) infrastructure() bool { return true }

// handlerFault is the eventline middleware's verdict that a failure that
// looks like a connection problem (a timeout, a network error) was the
// handler's own: the database answered, so the failure counts against the
// retry budget.
type handlerFault struct{ err error }

func (e *handlerFault) Error() string        { return e.err.Error() }
func (e *handlerFault) Unwrap() error        { return e.err }
func (e *handlerFault) infrastructure() bool { return false }

// verdict is implemented by errors that carry an explicit classification;
// the outermost one wins.
type verdict interface{ infrastructure() bool }

// IsInfrastructure reports whether err says the infrastructure, not the
// event or its handler, failed: the consumer must wait and retry, never
// spend the retry budget on it and never dead-letter the event. It is the
// one classification used by the retries, the dead letters, the consumer
// runner and the sweeper.
//
// It is true for:
//   - an error matching ErrInfrastructure, as the middleware returns for a
//     database that was unreachable, did not answer, or lost a commit (a
//     handler may wrap it too, to wait for a dependency of its own);
//   - PostgreSQL errors of SQLSTATE class 08 (connection exception), 53
//     (insufficient resources: disk full, out of memory, too many
//     connections), 58 (system error, I/O error) and 57P01 admin shutdown,
//     57P02 crash shutdown, 57P03 cannot connect now, 57P04 database
//     dropped, 57P05 idle session timeout;
//   - a failed connection attempt (*pgconn.ConnectError), a closed
//     connection or pool, a timeout inside pgx (pgconn.Timeout), and
//     network errors (connection refused or reset, broken pipe, EOF).
//
// It is false for nil, for permanent errors ([IsPermanent]), for every
// other SQLSTATE (a unique violation is the handler's fault; a
// serialization failure is a conflict, see [IsConflict]), and for errors
// the eventline middleware has judged to be the handler's own: a network
// error or timeout of a handler's call while the consumer's database kept
// answering. Errors returned by the eventline middleware carry that
// verdict; other errors are judged alone, and then any network error is
// taken for an outage (waiting too long is recoverable, dead-lettering by
// mistake is not).
func IsInfrastructure(err error) bool {
	if err == nil {
		return false
	}
	if IsPermanent(err) {
		return false
	}
	var v verdict
	if errors.As(err, &v) {
		return v.infrastructure()
	}
	if errors.Is(err, ErrInfrastructure) {
		return true
	}
	return pgerr.Unavailable(err)
}

// IsConflict reports whether err is a transaction conflict: a
// serialization failure (40001), a deadlock (40P01) or a lock that could
// not be taken in time (55P03). Retrying resolves it; it is retried on
// Config.Retry's schedule without spending the retry budget, since it says
// nothing about the event.
func IsConflict(err error) bool {
	return err != nil && !IsPermanent(err) && pgerr.HasCode(err, "40001", "40P01", "55P03")
}

// permanentState reports whether err is a PostgreSQL error of SQLSTATE
// class 22 or 54 (see IsPermanent).
func permanentState(err error) bool {
	var pg *pgconn.PgError
	if !errors.As(err, &pg) {
		return false
	}
	return strings.HasPrefix(pg.Code, "22") || strings.HasPrefix(pg.Code, "54")
}

// pgxEncodeFailure starts the message of the error pgx returns when it
// cannot encode a statement argument for its parameter's type (pgx has no
// error type for it).
const pgxEncodeFailure = "failed to encode args["

// encodeFailure reports whether err (or an error it wraps) is pgx's
// refusal to encode a statement argument (see IsPermanent). pgx checks it
// before sending anything, so PostgreSQL never gets to raise the class 22
// error it would raise for the same value.
func encodeFailure(err error) bool {
	for err != nil {
		if strings.HasPrefix(err.Error(), pgxEncodeFailure) {
			return true
		}
		switch u := err.(type) {
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				if encodeFailure(e) {
					return true
				}
			}
			return false
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		default:
			return false
		}
	}
	return false
}

// Failure stages of one event's transaction, for classification.
const (
	stageBegin   = "begin"
	stageHandler = "handler"
	stageCommit  = "commit"
)

// probeTimeout bounds the query that asks whether the database answers.
const probeTimeout = 5 * time.Second

// classify gives a failed attempt its verdict. parent is the attempt's
// context before the transaction deadline, ctx the one with it; lost says
// whether the transaction's connection was closed when the handler stage
// failed.
func (el *Eventline) classify(parent, ctx context.Context, stage string, lost bool, err error) error {
	if err == nil || IsPermanent(err) || errors.Is(err, ErrUnsafeComposition) || parent.Err() != nil {
		return err
	}
	var v verdict
	if errors.As(err, &v) {
		return err
	}
	ours := errors.Is(ctx.Err(), context.DeadlineExceeded)
	timedOut := ours || pgconn.Timeout(err) || errors.Is(err, context.DeadlineExceeded)
	var pg *pgconn.PgError
	isPg := errors.As(err, &pg)
	switch stage {
	case stageBegin, stageCommit:
		// eventline's own statements: anything but an SQL error is the
		// connection, and a commit whose outcome is unknown is retried
		// (the dedup record decides what the retry does).
		if isPg || (stage == stageCommit && errors.Is(err, pgx.ErrTxCommitRollback)) {
			return err
		}
		return &infraError{op: stage, err: err}
	}
	// The handler (or the gate's statements around it) failed.
	if isPg && !lost {
		return err
	}
	if !lost && !ours {
		// The transaction's connection is fine: a network error or timeout
		// of the handler's own calls is the handler's fault.
		if pgerr.ConnectionLost(err) {
			return &handlerFault{err: err}
		}
		return err
	}
	if timedOut {
		// A deadline ended the attempt. If the database does not answer
		// either, it is an outage; if it does, the handler was too slow
		// (TxTimeout) or its own deadline ended its query.
		if perr := el.probe(parent); perr != nil {
			return &infraError{op: stage, err: fmt.Errorf("%w (and the database did not answer a probe: %v)", err, perr)}
		}
		if ours {
			return &handlerFault{err: fmt.Errorf("eventline: the event's transaction took longer than middleware.Config.TxTimeout (%s) while the database kept answering; speed the handler up or raise TxTimeout: %w", el.cfg.TxTimeout, err)}
		}
		return &handlerFault{err: err}
	}
	// The connection died under the handler.
	return &infraError{op: stage, err: err}
}

// probe asks the database whether it answers, within probeTimeout.
func (el *Eventline) probe(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), probeTimeout)
	defer cancel()
	_, err := el.db.Exec(ctx, "SELECT 1")
	return err
}
