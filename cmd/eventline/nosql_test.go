package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// sqlOrQuery matches an SQL statement or a call that runs one.
var sqlOrQuery = regexp.MustCompile(`\b(SELECT|INSERT INTO|DELETE FROM|CREATE (TABLE|INDEX|SCHEMA)|ALTER TABLE|DROP (TABLE|SCHEMA)|TRUNCATE)\b|\bUPDATE \w+ SET\b|\.(Exec|Query|QueryRow)\(`)

// TestTheCommandHoldsNoSQL: the command calls the library (admin,
// migrations, producer) and its verifier and runs no SQL of its own. Only
// its own package's files are checked: the verifier
// (cmd/eventline/internal/verify) reads the tables itself, by design. A
// subtest first makes sure the check can fail.
func TestTheCommandHoldsNoSQL(t *testing.T) {
	t.Parallel()
	t.Run("the check fails on SQL", func(t *testing.T) {
		for _, src := range []string{`q := "SELECT 1"`, `pool.Exec(ctx, q)`, `"UPDATE outbox SET x = 1"`, `row := tx.QueryRow(ctx, q)`} {
			require.Regexp(t, sqlOrQuery, src)
		}
		for _, src := range []string{`// selects the shard`, `fmt.Println("update the topic")`, `admin.ReadStatus(ctx, pool, schema)`} {
			require.NotRegexp(t, sqlOrQuery, src)
		}
	})

	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	checked := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		for i, line := range strings.Split(string(src), "\n") {
			require.NotRegexp(t, sqlOrQuery, line, "%s:%d: the command runs no SQL of its own; call the library (admin, migrations) instead", f, i+1)
		}
		checked++
	}
	require.Greater(t, checked, 10, "the command's own files")
}
