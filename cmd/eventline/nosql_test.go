package main

import (
	"io/fs"
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
// admin/verify, migrations, producer) and runs no SQL of its own. Every
// non-test Go file of the module is read, the command's package and
// cmd/eventline/internal/... alike. A subtest first makes sure the check
// can fail.
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

	checked, files := map[string]bool{}, 0
	err := filepath.WalkDir(".", func(f string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(f, ".go") || strings.HasSuffix(f, "_test.go") {
			return err
		}
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		for i, line := range strings.Split(string(src), "\n") {
			require.NotRegexp(t, sqlOrQuery, line, "%s:%d: the command runs no SQL of its own; call the library (admin, admin/verify, migrations) instead", f, i+1)
		}
		checked[filepath.Dir(f)] = true
		files++
		return nil
	})
	require.NoError(t, err)
	require.Greater(t, files, 10)
	require.True(t, checked["."], "the command's own files")
	require.True(t, checked[filepath.Join("internal", "devkafka")], "the files under internal/")
}
