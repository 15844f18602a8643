package pgerr_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/pgerr"
)

func TestUnavailable(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"connection exception", &pgconn.PgError{Code: "08006"}, true},
		{"disk full", &pgconn.PgError{Code: "53100"}, true},
		{"I/O error", &pgconn.PgError{Code: "58030"}, true},
		{"admin shutdown", &pgconn.PgError{Code: "57P01"}, true},
		{"idle session timeout", &pgconn.PgError{Code: "57P05"}, true},
		{"query canceled", &pgconn.PgError{Code: "57014"}, false},
		{"unique violation", &pgconn.PgError{Code: "23505"}, false},
		{"undefined table", fmt.Errorf("read: %w", &pgconn.PgError{Code: pgerr.UndefinedTable}), false},
		{"connection refused", fmt.Errorf("dial: %w", syscall.ECONNREFUSED), true},
		{"EOF", io.ErrUnexpectedEOF, true},
		{"closed connection", pgconn.ErrConnClosed, true},
		{"another error", errors.New("boom"), false},
		{"cancelled", context.Canceled, false},
	} {
		require.Equal(t, c.want, pgerr.Unavailable(c.err), c.name)
	}
}

func TestHasCode(t *testing.T) {
	t.Parallel()
	err := fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: pgerr.InvalidSchemaName})
	require.True(t, pgerr.HasCode(err, pgerr.UndefinedTable, pgerr.InvalidSchemaName))
	require.False(t, pgerr.HasCode(err, pgerr.UndefinedTable))
	require.False(t, pgerr.HasCode(errors.New("not PostgreSQL's"), pgerr.UndefinedTable))
	require.False(t, pgerr.HasCode(nil, pgerr.UndefinedTable))
}
