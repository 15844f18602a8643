// Package extest holds what the examples' tests share: running an
// example's run function, reading the key=value output, a schema name per
// test, a logger that shows only when a test fails, the checks that an
// example left no goroutine and no database connection behind, and the
// test kit's fault schedules set up on an example's tables.
package extest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/eventlinetest"
	"github.com/eventline/eventline/examples/internal/setup"
)

// VerifyTestMain runs the tests, then fails if goroutines are left running.
func VerifyTestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Sarama's metrics registry starts a process-wide meter ticker.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

// Schema returns a schema name unique to this test run.
func Schema(prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return prefix + "_test_" + hex.EncodeToString(b[:])
}

// Common returns the shared example configuration for a test: the test
// database and brokers, a fresh schema named after prefix, and Logger(t).
func Common(t testing.TB, prefix string) setup.Common {
	return setup.Common{
		DatabaseURL: setup.DatabaseURL(),
		Brokers:     setup.BrokersFromEnv(),
		Schema:      Schema(prefix),
		Logger:      Logger(t),
	}
}

// Run runs an example's run function with cfg and a deadline of timeout,
// logs what it printed, fails the test if it returned an error, and
// returns its output.
func Run[C any](t testing.TB, timeout time.Duration, run func(ctx context.Context, cfg C, stdout io.Writer) error, cfg C) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var out bytes.Buffer
	err := run(ctx, cfg, &out)
	t.Logf("output:\n%s", out.String())
	require.NoError(t, err)
	return out.String()
}

// UnderFaults runs c with eventline's test kit on the test database, with
// the example's tables (ddl) created for every run: the handlers in c must
// leave the same State whatever the deliveries.
func UnderFaults(t testing.TB, ddl []string, c eventlinetest.Case) {
	t.Helper()
	c.DatabaseURL = setup.DatabaseURL()
	c.Setup = eventlinetest.SQL(ddl...)
	eventlinetest.Run(t, c)
}

// Event returns a new JSON event of type typ for the aggregate
// aggregateType/id, failing the test if payload does not encode.
func Event(t testing.TB, typ, aggregateType, id string, payload any) eventline.Event {
	t.Helper()
	e, err := eventline.NewJSONEvent(typ, aggregateType, id, payload)
	require.NoError(t, err)
	return e
}

// Logger returns a debug logger whose output is printed only if the test
// fails.
func Logger(t testing.TB) *slog.Logger {
	t.Helper()
	w := &lockedBuffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("logs:\n%s", w.String())
		}
	})
	return setup.Logger(w, slog.LevelDebug)
}

type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Line is one output line's key=value pairs, and its first bare word, if
// any ("progress", "first_relay"…).
type Line struct {
	Tag    string
	Fields map[string]string
}

// Parse reads key=value lines. Values may be Go-quoted strings.
func Parse(t testing.TB, out string) []Line {
	t.Helper()
	var lines []Line
	for _, raw := range strings.Split(strings.TrimSpace(out), "\n") {
		l := Line{Fields: map[string]string{}}
		for rest := strings.TrimSpace(raw); rest != ""; rest = strings.TrimLeft(rest, " ") {
			word, after, _ := strings.Cut(rest, " ")
			k, v, ok := strings.Cut(word, "=")
			if !ok {
				require.Empty(t, l.Tag, "line %q: only the first word may be bare", raw)
				require.Empty(t, l.Fields, "line %q: a bare word must come first", raw)
				l.Tag, rest = word, after
				continue
			}
			if strings.HasPrefix(v, `"`) {
				// A quoted value, which may hold spaces: up to its closing quote.
				q, err := strconv.QuotedPrefix(v + rest[len(word):])
				require.NoError(t, err, "line %q: value of %s", raw, k)
				v, _ = strconv.Unquote(q)
				after = rest[len(k)+1+len(q):]
			}
			_, dup := l.Fields[k]
			require.False(t, dup, "line %q: key %s twice", raw, k)
			l.Fields[k], rest = v, after
		}
		lines = append(lines, l)
	}
	return lines
}

// Find returns the last line that has every one of keys.
func Find(t testing.TB, lines []Line, keys ...string) map[string]string {
	t.Helper()
	for i := len(lines) - 1; i >= 0; i-- {
		ok := true
		for _, k := range keys {
			if _, has := lines[i].Fields[k]; !has {
				ok = false
				break
			}
		}
		if ok {
			return lines[i].Fields
		}
	}
	t.Fatalf("no output line has all of %v", keys)
	return nil
}

// Expect checks the last line that has every key of want, key=value pairs
// as the example prints them, against want's values, and returns that
// line's fields.
func Expect(t testing.TB, lines []Line, want string, msgAndArgs ...any) map[string]string {
	t.Helper()
	w := Parse(t, want)[0].Fields
	got := Find(t, lines, slices.Collect(maps.Keys(w))...)
	sub := map[string]string{}
	for k := range w {
		sub[k] = got[k]
	}
	require.Equal(t, w, sub, msgAndArgs...)
	return got
}

// Int returns the integer value of key.
func Int(t testing.TB, fields map[string]string, key string) int {
	t.Helper()
	v, ok := fields[key]
	require.True(t, ok, "missing %s", key)
	n, err := strconv.Atoi(v)
	require.NoError(t, err, "%s=%s", key, v)
	return n
}

// DropSchemaAtEnd drops schema when the test ends, for an example that
// leaves its schema behind.
func DropSchemaAtEnd(t testing.TB, schema string) {
	t.Cleanup(func() {
		ctx := context.Background()
		pool, err := setup.Pool(ctx, setup.DatabaseURL(), "eventline-example-test", 1)
		require.NoError(t, err)
		defer pool.Close()
		require.NoError(t, setup.DropSchema(ctx, pool, schema))
	})
}

// NoConnections fails the test if PostgreSQL still has sessions of the
// example that ran on schema (setup.AppName) after a short grace period (a
// closed pool's backends take a moment to exit).
func NoConnections(t testing.TB, schema string) {
	t.Helper()
	appName := setup.AppName(schema)
	ctx := context.Background()
	pool, err := setup.Pool(ctx, setup.DatabaseURL(), "eventline-example-test", 1)
	require.NoError(t, err)
	defer pool.Close()
	var n int
	deadline := time.Now().Add(5 * time.Second)
	for {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, appName).Scan(&n))
		if n == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	require.Zero(t, n, "connections named %s left open", appName)
}
