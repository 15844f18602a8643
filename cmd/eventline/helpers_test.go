package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/childproc"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/producer"
)

// envChildArgs, set (to a JSON array) in a child process started by
// startChild, makes the test binary run eventline's main with those
// arguments instead of the tests.
const envChildArgs = "EVENTLINE_CLI_TEST_CHILD_ARGS"

func TestMain(m *testing.M) {
	if args := os.Getenv(envChildArgs); args != "" {
		var list []string
		if err := json.Unmarshal([]byte(args), &list); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		os.Args = append([]string{"eventline"}, list...)
		main() // exits
	}
	goleak.VerifyTestMain(m,
		// Sarama's metrics registry starts this once per process.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

// syncBuffer is a bytes.Buffer safe for a command writing while the test
// reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// noEnv is an empty environment: tests pass every setting as a flag, so a
// developer's DATABASE_URL or KAFKA_BROKERS cannot leak in.
func noEnv(string) string { return "" }

// result is one finished CLI run.
type result struct {
	code           int
	stdout, stderr string
}

// cli runs eventline in-process with the given arguments, as is.
func cli(t testing.TB, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errw syncBuffer
	code := runWithEnv(ctx, args, &out, &errw, noEnv)
	r := result{code: code, stdout: out.String(), stderr: errw.String()}
	t.Logf("eventline %s -> %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	return r
}

// dbArgs are the global flags naming the test database and schema.
func dbArgs(schema string) []string {
	return []string{"-database-url", pgtest.URL(), "-schema", schema}
}

// ok runs a command against schema and requires exit code 0.
func ok(t testing.TB, schema string, args ...string) string {
	t.Helper()
	r := cli(t, append(dbArgs(schema), args...)...)
	require.Equal(t, 0, r.code, "eventline %v failed: %s", args, r.stderr)
	return r.stdout
}

// okJSON runs a command against schema and decodes its JSON output.
func okJSON[T any](t testing.TB, schema string, args ...string) T {
	t.Helper()
	var v T
	out := ok(t, schema, args...)
	require.NoError(t, json.Unmarshal([]byte(out), &v), "output is not JSON: %s", out)
	return v
}

// testBundle is what a test of a command starts from: its own migrated
// schema and, for the tests that relay, a fresh topic on the test brokers.
type testBundle struct {
	env     pgtest.Env
	brokers []string
	topic   string // empty without Kafka
}

// setup returns a schema with shards outbox shards and, when partitions is
// above 0, an "orders" topic of that many partitions (relaytest.Setup).
func setup(t *testing.T, shards int, partitions int32) testBundle {
	t.Helper()
	opts := pgtest.Options{Shards: shards}
	if partitions == 0 {
		return testBundle{env: pgtest.New(t, opts)}
	}
	var b testBundle
	b.env, b.brokers, b.topic = relaytest.Setup(t, opts, partitions)
	return b
}

// relayArgs are the flags of a quick test relay for the bundle's schema
// and brokers.
func (b testBundle) relayArgs(extra ...string) []string {
	args := append(dbArgs(b.env.Schema), "relay", "-brokers", strings.Join(b.brokers, ","),
		"-poll-interval", "100ms", "-rebalance-interval", "100ms", "-cleanup-interval", "0")
	return append(args, extra...)
}

// background is a long-running command (relay, kafka-dev) started in
// another goroutine.
type background struct {
	stdout, stderr *syncBuffer
	cancel         context.CancelFunc
	done           chan int
}

// start runs eventline with args until stop is called or the test ends.
func start(t testing.TB, args ...string) *background {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	b := &background{stdout: &syncBuffer{}, stderr: &syncBuffer{}, cancel: cancel, done: make(chan int, 1)}
	go func() { b.done <- runWithEnv(ctx, args, b.stdout, b.stderr, noEnv) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-b.done:
		case <-time.After(time.Minute):
			t.Error("eventline did not stop within a minute of its context ending")
		}
		t.Logf("eventline %s\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), b.stdout, b.stderr)
	})
	return b
}

// stop cancels the command's context (as SIGINT would) and returns its
// exit code.
func (b *background) stop(t testing.TB) int {
	t.Helper()
	b.cancel()
	select {
	case code := <-b.done:
		b.done <- code // for the cleanup
		return code
	case <-time.After(time.Minute):
		t.Fatal("eventline did not stop within a minute of its context ending")
		return -1
	}
}

// exited reports whether the command has ended on its own.
func (b *background) exited() bool {
	select {
	case code := <-b.done:
		b.done <- code
		return true
	default:
		return false
	}
}

// waitOutput waits until w contains substr and returns the output so far.
func waitOutput(t testing.TB, b *background, w *syncBuffer, substr string) string {
	t.Helper()
	require.Eventually(t, func() bool {
		return b.exited() || strings.Contains(w.String(), substr)
	}, time.Minute, 20*time.Millisecond, "waiting for %q", substr)
	out := w.String()
	require.Contains(t, out, substr, "eventline exited early:\n%s", b.stderr)
	return out
}

// publish writes events for aggregates of type "order" into env's outbox,
// one transaction, and returns them.
func publish(t testing.TB, env pgtest.Env, topic string, ids ...string) []eventline.Event {
	t.Helper()
	p, err := producer.New(context.Background(), env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: topic})
	require.NoError(t, err)
	var events []eventline.Event
	for i, id := range ids {
		e, err := eventline.NewJSONEvent("order.updated", "order", id, map[string]int{"n": i})
		require.NoError(t, err)
		e.ID = eventline.NewEventID()
		events = append(events, e)
	}
	require.NoError(t, p.Publish(context.Background(), env.Pool, events...))
	return events
}

func jsonUnmarshal(s string, v any) error { return json.Unmarshal([]byte(s), v) }

// startChild runs eventline's real main (signal handling included) with
// args in a child process of the test binary.
func startChild(t testing.TB, args ...string) *childproc.Proc {
	t.Helper()
	b, err := json.Marshal(args)
	require.NoError(t, err)
	return childproc.Start(t, envChildArgs+"="+string(b), "DATABASE_URL=", "KAFKA_BROKERS=", "EVENTLINE_SCHEMA=")
}
