// Package pgerr classifies PostgreSQL errors for the producer, the relay,
// the consumer's middleware and the CLI, so they agree on what "the
// database is unavailable" means.
package pgerr

import (
	"errors"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
)

// SQLSTATEs eventline tells apart.
const (
	UndefinedTable       = "42P01"
	InvalidSchemaName    = "3F000"
	ProgramLimitExceeded = "54000"
)

// Unavailable reports whether err says PostgreSQL cannot serve now rather
// than that the statement or its data is wrong: SQLSTATE class 08
// (connection exception), 53 (insufficient resources), 58 (system error),
// 57P01–57P05 (shutdown, crash, cannot connect now, database dropped, idle
// session timeout), or a connection that failed (ConnectionLost).
func Unavailable(err error) bool {
	if err == nil {
		return false
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		switch pg.Code {
		case "57P01", "57P02", "57P03", "57P04", "57P05":
			return true
		}
		return strings.HasPrefix(pg.Code, "08") || strings.HasPrefix(pg.Code, "53") || strings.HasPrefix(pg.Code, "58")
	}
	return ConnectionLost(err)
}

// ConnectionLost reports whether err comes from a connection that failed:
// connecting, talking to the server, or waiting for it (a closed
// connection or pool, a timeout inside pgx, a network error, EOF).
func ConnectionLost(err error) bool {
	var ce *pgconn.ConnectError
	var ne net.Error
	switch {
	case errors.As(err, &ce), pgconn.Timeout(err), errors.As(err, &ne):
		return true
	case errors.Is(err, pgconn.ErrConnClosed), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, net.ErrClosed):
		return true
	}
	for _, e := range []error{syscall.ECONNREFUSED, syscall.ECONNRESET, syscall.ECONNABORTED, syscall.EPIPE,
		syscall.ETIMEDOUT, syscall.EHOSTUNREACH, syscall.ENETUNREACH, syscall.ENETDOWN} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// HasCode reports whether err is (or wraps) a PostgreSQL error with one of
// codes as its SQLSTATE.
func HasCode(err error, codes ...string) bool {
	var pg *pgconn.PgError
	if !errors.As(err, &pg) {
		return false
	}
	for _, c := range codes {
		if pg.Code == c {
			return true
		}
	}
	return false
}
