package producer_test

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// TestRelaySessionsKeepThePoolsApplicationName: operators tell services
// apart in pg_stat_activity by the application_name they give their pools.
// The relay's own sessions (ownership and LISTEN) keep it and add the
// relay's identity; before the fix they replaced it with
// "eventline-relay", so a relay's sessions could not be told from another
// service's.
func TestRelaySessionsKeepThePoolsApplicationName(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	var tag [4]byte
	_, _ = rand.Read(tag[:])
	name := "billing-svc-" + hex.EncodeToString(tag[:])
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["application_name"] = name
	cfg.MaxConns = producer.PoolSizeFor(1)
	ctx := context.Background()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	_, stop := relaytest.Run(t, pool, producer.RelayConfig{Schema: env.Schema, Brokers: kafkatest.Brokers(t),
		PollInterval: 200 * time.Millisecond, RebalanceInterval: 250 * time.Millisecond, Logger: relaytest.Logger(t)})
	owners := waitOwners(t, env, 1)
	var ownership string
	require.NoError(t, env.Pool.QueryRow(ctx, `SELECT application_name FROM pg_stat_activity WHERE pid = $1`, owners[0].BackendPID).Scan(&ownership))
	require.Equal(t, name+" (eventline-relay)", ownership, "the ownership session")
	require.Eventually(t, func() bool {
		// The ownership and the LISTEN session.
		return pgtest.Count(t, env.Pool, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, name+" (eventline-relay)") == 2
	}, 30*time.Second, 20*time.Millisecond)
	stop()
}

// TestRelaySendsNothingAfterItsLeaseRanOut: a relay that cannot renew its
// lease stops relaying before anyone else may take the shard. Its timer
// stops the shard at the lease's local deadline, but a process resumed
// after a pause (SIGSTOP, a VM freeze) runs its goroutines and its fired
// timers in any order: a row the guard let through before the pause could
// be sent before the timer stopped the shard. Here the publish path is
// held (a hook) between the guard and the send while renewals are blocked
// (the lease tables locked); once the lease's deadline has passed, the
// timer is held in turn (another hook) and the publish path goes on.
// Before the fix the record reached Kafka then, after the lease had run
// out; now the deadline is checked right before each send, by the
// monotonic clock, and the next owner sends it.
func TestRelaySendsNothingAfterItsLeaseRanOut(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1}, 1)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	metrics, err := producer.NewRelayMetrics(reg)
	require.NoError(t, err)
	cfg := producer.RelayConfig{Schema: env.Schema, Brokers: brokers, PollInterval: 200 * time.Millisecond,
		RebalanceInterval: 200 * time.Millisecond, Logger: relaytest.Logger(t)}

	held := relaytest.PublishOrders(t, env, topic, 1, 1, 1)[0]
	atSend, resume := make(chan struct{}), make(chan struct{})
	var sendOnce sync.Once
	restoreSend := producer.SetBeforeSendHook(func(schema string, _ int, eventID string) {
		if schema == env.Schema && eventID == held.ID {
			sendOnce.Do(func() { close(atSend); <-resume })
		}
	})
	defer restoreSend()
	expired, thaw := make(chan struct{}), make(chan struct{})
	var timerOnce sync.Once
	restoreTimer := producer.SetLeaseTimerHook(func(schema string, _ int) {
		if schema == env.Schema {
			timerOnce.Do(func() { close(expired); <-thaw })
		}
	})
	defer restoreTimer()
	defer close(thaw)

	_, stop := relaytest.Run(t, env.Pool, withMetrics(cfg, metrics))
	waitFor(t, atSend, "the relay never reached the send")
	lock, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = lock.Rollback(ctx) }()
	_, err = lock.Exec(ctx, `LOCK TABLE `+sqlident.Qualify(env.Schema, "relay_leases")+`, `+sqlident.Qualify(env.Schema, "relay_members")+` IN EXCLUSIVE MODE`)
	require.NoError(t, err)
	waitFor(t, expired, "the shard's lease never ran out")
	close(resume)
	// The publish path decides: it stops the shard for its lease (counted),
	// or it sends, and the batch's position moves once Kafka has the record.
	require.Eventually(t, func() bool {
		_, offset, err := positionOf(ctx, env.Pool, env.Schema, 0)
		require.NoError(t, err)
		return offset > 0 || metrictest.Sum(t, reg, "eventline_relay_lease_expired_total") > 0
	}, time.Minute, 10*time.Millisecond)
	stop() // Run returns once its Kafka producer has flushed what it was given
	sent, err := kafkatest.ReadTopic(ctx, brokers, topic)
	require.NoError(t, err)
	require.Empty(t, sent, "the event was sent after the relay's lease had run out")

	// Not lost: the next owner sends it.
	require.NoError(t, lock.Rollback(ctx))
	_, stop = relaytest.Run(t, env.Pool, cfg)
	relaytest.RequireAllDelivered(t, brokers, topic, []string{held.ID}, time.Minute)
	stop()
}

func waitFor(t *testing.T, ch <-chan struct{}, msg string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(time.Minute):
		t.Fatal(msg)
	}
}

// runInBackground runs r until the returned stop is called, and returns
// Run's result channel (filled once).
func runInBackground(t *testing.T, r *producer.Relay) (done chan error, stop context.CancelFunc) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done = make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Error("relay did not stop within a minute")
		}
	})
	return done, cancel
}

// returned reports whether Run has returned, leaving its result for the
// clean-up.
func returned(done chan error) bool {
	select {
	case err := <-done:
		done <- err
		return true
	default:
		return false
	}
}

// A relay started while its database refuses connections, or accepts them
// and never answers, waits for it and then relays. Before, NewRelay failed
// on the refused connection ("read outbox shard count: failed to
// connect"), so a relay process started during a database restart or
// failover exited, and `eventline relay` with it.
func TestRelayStartedDuringADatabaseOutageWaitsForIt(t *testing.T) {
	t.Parallel()
	for name, mode := range map[string]faultproxy.Mode{"refused": faultproxy.Refuse, "not answering": faultproxy.Freeze} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 2}, 3)
			events := relaytest.PublishOrders(t, env, topic, 4, 20, 5)

			proxy := startProxy(t)
			proxy.Set(mode)
			pool := proxiedPool(t, proxy, producer.PoolSizeFor(env.Shards))
			logs := newLogRecorder(t, slog.LevelInfo)
			r, err := producer.NewRelay(context.Background(), pool, producer.RelayConfig{
				Schema: env.Schema, Brokers: brokers, Logger: slog.New(logs),
				PollInterval: 200 * time.Millisecond, RebalanceInterval: 250 * time.Millisecond,
			})
			require.NoError(t, err, "an unavailable database is not a configuration error")
			require.Zero(t, producer.ShardCount(r), "the shard count is not known yet")

			done, stop := runInBackground(t, r)
			waits := func() int {
				n := 0
				for _, l := range logs.at(slog.LevelWarn) {
					if strings.Contains(l, "PostgreSQL is unavailable; waiting for it before relaying") {
						n++
					}
				}
				return n
			}
			require.Eventually(t, func() bool { return returned(done) || waits() >= 2 }, time.Minute, 10*time.Millisecond,
				"the relay tries the database several times, saying so")
			require.False(t, returned(done), "Run returned during the outage: %v", logs.at(slog.LevelWarn))
			require.Empty(t, logs.at(slog.LevelError))

			proxy.Set(faultproxy.Pass)
			counts := relaytest.Distinct(readTopic(t, brokers, topic, len(events), time.Minute))
			require.Len(t, counts, len(events), "the relay relays once the database answers")
			require.Equal(t, env.Shards, producer.ShardCount(r))
			stop()
			require.NoError(t, <-done)
			done <- nil
			require.Empty(t, logs.at(slog.LevelError))
		})
	}
}

// A relay stopped while it waits for the database returns nil, and one
// whose schema turns out not to be migrated when the database answers
// fails with ErrNotMigrated: that is a configuration error, not an outage.
func TestRelayStartedDuringADatabaseOutageStillRefusesAnUnmigratedSchema(t *testing.T) {
	t.Parallel()
	proxy := startProxy(t)
	proxy.Set(faultproxy.Refuse)
	pool := proxiedPool(t, proxy, producer.PoolSizeFor(4))
	newRelay := func(schema string) *producer.Relay {
		r, err := producer.NewRelay(context.Background(), pool, producer.RelayConfig{
			Schema: schema, Brokers: []string{"127.0.0.1:1"}, Logger: relaytest.Logger(t),
		})
		require.NoError(t, err)
		return r
	}

	stopped := newRelay("missing_schema")
	done, stop := runInBackground(t, stopped)
	require.Eventually(t, func() bool { return returned(done) || proxy.Refused() >= 2 }, time.Minute, 10*time.Millisecond)
	require.False(t, returned(done), "Run returned during the outage")
	stop()
	require.NoError(t, <-done, "a stop during the wait is clean")
	done <- nil

	unmigrated := newRelay("missing_schema")
	done, _ = runInBackground(t, unmigrated)
	before := proxy.Refused()
	require.Eventually(t, func() bool { return returned(done) || proxy.Refused() > before }, time.Minute, 10*time.Millisecond)
	require.False(t, returned(done), "Run returned during the outage")
	proxy.Set(faultproxy.Pass)
	var runErr error
	require.Eventually(t, func() bool {
		select {
		case runErr = <-done:
			done <- runErr
			return true
		default:
			return false
		}
	}, time.Minute, 10*time.Millisecond, "Run fails once the database answers")
	require.ErrorIs(t, runErr, producer.ErrNotMigrated)

	// With the database up, NewRelay reports it at once, as before.
	_, err := producer.NewRelay(context.Background(), pool, producer.RelayConfig{Schema: "missing_schema", Brokers: []string{"127.0.0.1:1"}})
	require.ErrorIs(t, err, producer.ErrNotMigrated)
}

// A caller's deadline, or a cancel with a cause, is a request to stop: Run
// returns nil and logs "relay stopped" at INFO, not at ERROR. Before, Run
// returned context.DeadlineExceeded and logged ERROR "relay stopped" for
// any cause but context.Canceled.
func TestRelayRunStopsCleanlyAtTheCallersDeadline(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	brokers := kafkatest.Brokers(t)
	for name, cause := range map[string]error{
		"deadline": context.DeadlineExceeded,
		"cause":    errors.New("the service is shutting down"),
	} {
		t.Run(name, func(t *testing.T) {
			logs := newLogRecorder(t, slog.LevelInfo)
			r, err := producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{
				Schema: env.Schema, Brokers: brokers, Logger: slog.New(logs),
				PollInterval: 200 * time.Millisecond, RebalanceInterval: 250 * time.Millisecond,
			})
			require.NoError(t, err)
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx) }()
			require.Eventually(t, func() bool { return len(producer.OwnedShards(r)) == env.Shards }, time.Minute, 10*time.Millisecond)
			cancel(cause) // what a context.WithTimeout does when its time is up
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(time.Minute):
				t.Fatal("relay did not stop within a minute")
			}
			require.Empty(t, logs.at(slog.LevelError))
			require.True(t, slices.ContainsFunc(logs.at(slog.LevelInfo), func(l string) bool { return strings.HasPrefix(l, "INFO relay stopped ") }),
				"an INFO line says the relay stopped")
		})
	}

	// And with a real deadline.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	logs := newLogRecorder(t, slog.LevelError)
	r, err := producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{Schema: env.Schema, Brokers: brokers, Logger: slog.New(logs)})
	require.NoError(t, err)
	require.NoError(t, r.Run(ctx))
	require.Empty(t, logs.at(slog.LevelError))
}

// When an event's topic does not exist, the relay's publish errors say so
// and what to do, also once Sarama's circuit breaker opens and its errors
// become a bare "circuit breaker is open"; and once the topic is created,
// the relay publishes to it by itself. Before, after the first attempts
// every error was "circuit breaker is open", with no hint of the cause.
func TestRelayNamesAMissingTopic(t *testing.T) {
	t.Parallel()
	brokers := kafkatest.Brokers(t) // like a production cluster: no topic created on first use
	missing := kafkatest.Topic(t, "missing")
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	events := relaytest.PublishOrders(t, env, missing, 1, 1, 1)

	logs := newLogRecorder(t, slog.LevelWarn)
	relaytest.Start(t, env, producer.RelayConfig{
		Brokers: brokers, Logger: slog.New(logs),
		Backoff: eventline.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond, Multiplier: 1}, MaxAttempts: 1000, // never dead-lettered here
	})
	hinted := func(l string) bool {
		return strings.Contains(l, `Kafka topic "`+missing+`" does not exist, and eventline creates no topics`) &&
			strings.Contains(l, "eventline kafka-dev -topics "+missing)
	}
	var breakerLine string
	require.Eventually(t, func() bool {
		for _, l := range logs.at(slog.LevelWarn) {
			if strings.Contains(l, "publish failed") && strings.Contains(l, "circuit breaker is open") {
				breakerLine = l
				return true
			}
		}
		return false
	}, time.Minute, 20*time.Millisecond, "Sarama's breaker opens")
	require.True(t, hinted(breakerLine), "the breaker's error names the missing topic: %s", breakerLine)
	for _, l := range logs.at(slog.LevelWarn) {
		if strings.Contains(l, "publish failed") {
			require.True(t, hinted(l), "every publish failure names the missing topic: %s", l)
		}
	}

	kafkatest.CreateTopic(t, brokers, missing, 1)
	require.Len(t, relaytest.Distinct(readTopic(t, brokers, missing, len(events), time.Minute)), len(events), "published once the topic exists")
}

// txPooler is a minimal transaction-mode connection pooler, as PgBouncer
// with pool_mode = transaction behaves for what matters here: every client
// connection is served by two server connections in turn, switching
// whenever the server reports it is idle outside a transaction, and what a
// server sends while its client is not linked to it (a notification) never
// reaches the client. It speaks just enough of the protocol for trust
// authentication and the simple query protocol.
type txPooler struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  []net.Conn
}

func startTxPooler(t *testing.T) *txPooler {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &txPooler{ln: ln, target: pgtest.Addr()}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Add(1)
			go func() { defer p.wg.Done(); p.serve(c) }()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *txPooler) track(c net.Conn) {
	p.mu.Lock()
	p.conns = append(p.conns, c)
	p.mu.Unlock()
}

// readStartup reads an untyped startup-phase message.
func readStartup(r io.Reader) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	msg := make([]byte, binary.BigEndian.Uint32(hdr[:]))
	copy(msg, hdr[:])
	_, err := io.ReadFull(r, msg[4:])
	return msg, err
}

// readMsg reads a typed protocol message.
func readMsg(r io.Reader) ([]byte, error) {
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	msg := make([]byte, 1+binary.BigEndian.Uint32(hdr[1:]))
	copy(msg, hdr[:])
	_, err := io.ReadFull(r, msg[5:])
	return msg, err
}

func (p *txPooler) serve(client net.Conn) {
	p.track(client)
	defer client.Close()
	startup, err := readStartup(client)
	if err != nil {
		return
	}
	if binary.BigEndian.Uint32(startup[4:8]) == 80877103 { // SSLRequest: no
		if _, err := client.Write([]byte{'N'}); err != nil {
			return
		}
		if startup, err = readStartup(client); err != nil {
			return
		}
	}
	var servers [2]net.Conn
	for i := range servers {
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			return
		}
		p.track(s)
		defer s.Close()
		if _, err := s.Write(startup); err != nil {
			return
		}
		// Up to the first ReadyForQuery; only the first server's greeting
		// reaches the client.
		for {
			msg, err := readMsg(s)
			if err != nil {
				return
			}
			if i == 0 {
				if _, err := client.Write(msg); err != nil {
					return
				}
			}
			if msg[0] == 'Z' {
				break
			}
		}
		servers[i] = s
	}
	var mu sync.Mutex
	current := 0
	for i, s := range servers {
		go func() {
			for {
				msg, err := readMsg(s)
				if err != nil {
					_ = client.Close()
					return
				}
				mu.Lock()
				linked := current == i
				if linked {
					_, _ = client.Write(msg)
					if msg[0] == 'Z' && msg[5] == 'I' {
						current = 1 - current // idle: the next transaction goes elsewhere
					}
				}
				mu.Unlock()
			}
		}()
	}
	for {
		msg, err := readMsg(client)
		if err != nil {
			return
		}
		if msg[0] == 'X' {
			return
		}
		mu.Lock()
		s := servers[current]
		mu.Unlock()
		if _, err := s.Write(msg); err != nil {
			return
		}
	}
}

// TestRelayRefusesATransactionModePooler: behind a transaction-mode pooler
// a relay's LISTEN lands on a server connection it does not hold, and its
// session settings on connections others get. Run must refuse with
// ErrSessionPooling and say what to do, instead of running with lost
// wake-ups.
func TestRelayRefusesATransactionModePooler(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	pooler := startTxPooler(t)
	cfg, err := pgxpool.ParseConfig(pgtest.URLVia(pooler.ln.Addr().String()) + "&default_query_exec_mode=simple_protocol")
	require.NoError(t, err)
	cfg.MaxConns = 6
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	// The pooler does what a transaction-mode pooler does: one client
	// connection, a different server process for the next transaction.
	conn, err := pool.Acquire(context.Background())
	require.NoError(t, err)
	var pid1, pid2 int32
	require.NoError(t, conn.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&pid1))
	require.NoError(t, conn.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&pid2))
	conn.Release()
	require.NotEqual(t, pid1, pid2)

	r, err := producer.NewRelay(context.Background(), pool, producer.RelayConfig{
		Schema: env.Schema, Brokers: kafkatest.Brokers(t), Logger: relaytest.Logger(t), RebalanceInterval: 250 * time.Millisecond,
	})
	require.NoError(t, err, "producers and consumers work through the pooler, and so does NewRelay")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err = r.Run(ctx)
	require.True(t, errors.Is(err, producer.ErrSessionPooling), "got %v", err)
	require.ErrorContains(t, err, "session mode")
	owners, err := admin.ShardOwners(context.Background(), env.Pool, env.Schema)
	require.NoError(t, err)
	require.Empty(t, owners, "a refused relay owns nothing")
}
