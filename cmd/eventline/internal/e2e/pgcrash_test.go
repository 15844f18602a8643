package e2e_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// TestPostgresCrashRestartLosesNothing runs producer ▸ relay ▸ Kafka ▸
// consumer on a PostgreSQL cluster of its own (outbox and consumer tables
// in one database) and crashes that cluster two or three times
// (pg_ctlcluster restart -m immediate: no checkpoint, WAL recovery on
// start) at seeded random moments while events are published. Publishes
// that fail during a crash were never committed, or (the commit's
// acknowledgement lost) committed: the outbox after the crashes is the
// truth. Then every event in it, which includes every publish that
// succeeded, is applied once, in per-aggregate order, nothing is
// dead-lettered, parked or skipped, and admin/verify reports nothing.
// Rerun a failure with EVENTLINE_CHAOS_SEED set to the logged seed.
func TestPostgresCrashRestartLosesNothing(t *testing.T) {
	seed, rng := longChaosTest(t, "creates a PostgreSQL cluster and crashes it: about half a minute")
	ctx := context.Background()

	pg := newPGCluster(t)
	dbURL := pg.createDatabase("eventline")
	// Each component has its own pool, as separate processes would.
	newPool := func(maxConns int32) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(dbURL)
		require.NoError(t, err)
		cfg.MaxConns = maxConns
		cfg.ConnConfig.ConnectTimeout = time.Second
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		return pool
	}
	const schema, shards = "eventline", 2
	checks := newPool(4)
	require.NoError(t, migrations.Up(ctx, checks, migrations.Config{Schema: schema, Shards: shards}))
	env := pgtest.Env{Pool: checks, Schema: schema, Shards: shards}
	prodPool := newPool(4)
	r := newRig(t, env, prodPool, kafkatest.Start(t, kafkatest.Config{}), "pgcrash", 3, nil)
	effects := r.table("pgcrash_effects")
	_, err := checks.Exec(ctx, `CREATE TABLE `+effects+` (seq bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL)`)
	require.NoError(t, err)

	rel, err := producer.NewRelay(ctx, newPool(8), chaosRelayConfig(schema, r.brokers))
	require.NoError(t, err)
	stopRelay := relaytest.Background(t, rel.Run)

	// The consumer: default park timeout (an hour: nothing may be skipped
	// in this run).
	group := kafkatest.Topic(t, "pgcrash") // unique: the broker may be shared
	reg := prometheus.NewRegistry()
	metrics, err := middleware.NewMetrics(reg)
	require.NoError(t, err)
	cfg := r.consumerConfig(group, versioning.HoldLate, metrics)
	cfg.ParkTimeout = 0
	c, err := consumer.New(newPool(6), cfg)
	require.NoError(t, err)
	require.NoError(t, c.Handle("order.updated", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+effects+` (event_id, aggregate_id, version) VALUES ($1, $2, $3)`, e.ID, e.AggregateID, e.AggregateVersion)
		return err
	}))
	stopConsumer := relaytest.Background(t, c.Run)

	// The producer: 16 aggregates, a few events at a time, until the
	// crashes are over. A publish that fails (the database crashed or is
	// recovering) is not retried: its events are "failed", committed or not.
	var mu sync.Mutex
	succeeded, failed := map[string]bool{}, map[string]bool{}
	var succeededInOrder []string
	var publishErrs []string
	stopPublishing := publishRandomly(seed, func(evs []eventline.Event) bool {
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := r.prod.Publish(pctx, prodPool, evs...)
		cancel()
		mu.Lock()
		defer mu.Unlock()
		for _, e := range evs {
			if err == nil {
				succeeded[e.ID] = true
				succeededInOrder = append(succeededInOrder, e.ID)
			} else {
				failed[e.ID] = true
			}
		}
		if err != nil && len(publishErrs) < 5 {
			publishErrs = append(publishErrs, err.Error())
		}
		return true
	})

	// applied counts the group's applied events; it fails (-1) while the
	// database is down or recovering.
	applied := func() int {
		var n int
		if err := checks.QueryRow(ctx, `SELECT count(*) FROM `+r.table("processed_events")+` WHERE consumer_group = $1 AND outcome = 'applied'`, group).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	// waitProgress waits until an event published from now on is applied:
	// producer, relay and consumer all work (again).
	waitProgress := func(why string) {
		t.Helper()
		mu.Lock()
		mark := len(succeededInOrder)
		mu.Unlock()
		var id string
		for deadline := time.Now().Add(time.Minute); ; {
			mu.Lock()
			if id == "" && len(succeededInOrder) > mark {
				id = succeededInOrder[mark]
			}
			mu.Unlock()
			if id != "" {
				var n int
				if err := checks.QueryRow(ctx, `SELECT count(*) FROM `+effects+` WHERE event_id = $1`, id).Scan(&n); err == nil && n > 0 {
					return
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("seed %d: no event published and applied within a minute %s (published %q; %d applied)", seed, why, id, applied())
			}
			time.Sleep(50 * time.Millisecond) // polling interval
		}
	}
	waitProgress("of the start")

	// The crashes, two or three, each at a random moment once the pipeline
	// works again after the previous one.
	crashes := 2 + rng.IntN(2)
	var log []string
	for i := range crashes {
		calm := time.Duration(500+rng.IntN(2500)) * time.Millisecond
		time.Sleep(calm) // the pipeline runs undisturbed until the crash
		before := applied()
		pg.crash()
		log = append(log, fmt.Sprintf("crash %d after %s (%d applied)", i+1, calm, before))
		waitProgress(fmt.Sprintf("of crash %d", i+1))
	}
	stopPublishing()
	mu.Lock()
	t.Logf("%d events published, %d in failed publishes; %s; first publish errors: %s",
		len(succeeded), len(failed), strings.Join(log, "; "), strings.Join(publishErrs, " | "))
	mu.Unlock()
	require.NotEmpty(t, failed, "seed %d: no publish failed: did the crashes happen?", seed)

	// The outbox after the crashes holds every event whose publish
	// committed: the succeeded, and failed ones whose commit's
	// acknowledgement was lost. (A succeeded publish missing here is a
	// commit PostgreSQL lost, as it may with synchronous_commit=off: not the
	// pipeline's doing.)
	inOutbox := map[string]bool{}
	for shard := range shards {
		rows, err := checks.Query(ctx, `SELECT payload->>'uuid' FROM `+r.table(outbox.Table(shard)))
		require.NoError(t, err)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		for _, id := range ids {
			require.False(t, inOutbox[id], "seed %d: event %s twice in the outbox", seed, id)
			require.True(t, succeeded[id] || failed[id], "seed %d: event %s in the outbox, but never published", seed, id)
			inOutbox[id] = true
		}
	}
	for id := range succeeded {
		require.True(t, inOutbox[id], "seed %d: event %s published (committed) but not in the outbox after the crashes", seed, id)
	}
	outboxEvents := len(inOutbox)
	for deadline := time.Now().Add(2 * time.Minute); applied() < outboxEvents; {
		if time.Now().After(deadline) {
			t.Fatalf("seed %d: %d of %d events applied two minutes after the crashes", seed, applied(), outboxEvents)
		}
		time.Sleep(50 * time.Millisecond) // polling interval
	}
	p := &pipeline{t: t, env: env, brokers: r.brokers, topic: r.topic}
	p.waitConsumed(group)
	stopConsumer()
	stopRelay()

	// Every succeeded publish applied; every applied event published.
	rows, err := checks.Query(ctx, `SELECT event_id FROM `+effects)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	appliedIDs := map[string]bool{}
	ambiguous := 0
	for _, id := range ids {
		appliedIDs[id] = true
		require.True(t, inOutbox[id], "seed %d: event %s applied, but not in the outbox", seed, id)
		if !succeeded[id] {
			ambiguous++
		}
	}
	for id := range inOutbox {
		require.True(t, appliedIDs[id], "seed %d: event %s committed but never applied", seed, id)
	}
	t.Logf("%d events in the outbox: %d published, %d of failed publishes that committed; the consumer waited on the database %v times, retried %v times, recognised %v duplicates",
		outboxEvents, len(succeeded), ambiguous, metrictest.Sum(t, reg, "eventline_consumer_infra_waits_total"),
		metrictest.Sum(t, reg, "eventline_consumer_retries_total"), metrictest.Sum(t, reg, "eventline_consumer_events_duplicate_total"))
	require.Zero(t, metrictest.Sum(t, reg, "eventline_consumer_events_dead_lettered_total"), "seed %d: the consumer dead-lettered", seed)
	require.Equal(t, outboxEvents, len(ids), "seed %d: every outbox event applied", seed)

	r.requireAppliedOnceInOrder(seed, effects)
	for _, table := range []string{"held_events", "relay_failures", "skipped_versions", "parked_events"} {
		require.Zero(t, r.count(`SELECT count(*) FROM `+r.table(table)), "seed %d: rows in %s", seed, table)
	}

	r.requireVerifyClean(ctx, seed, group, effects, outboxEvents)
}

// pgCluster is a PostgreSQL 15 cluster of the test's own (Debian's
// postgresql-common: pg_createcluster, pg_ctlcluster), on a free port, with
// trust authentication, so the test can crash it without touching the
// shared server. It is stopped and dropped when the test ends.
type pgCluster struct {
	t    *testing.T
	name string
	port int
}

// pgClusterVersion is the PostgreSQL major version the clusters run.
const pgClusterVersion = "15"

// newPGCluster creates and starts a cluster, or skips the test when this
// machine cannot create one (postgresql-common missing, not root nor
// postgres).
func newPGCluster(t *testing.T) *pgCluster {
	t.Helper()
	if _, err := exec.LookPath("pg_createcluster"); err != nil {
		t.Skip("pg_createcluster (postgresql-common) is not installed: cannot create a PostgreSQL cluster to crash")
	}
	if _, err := os.Stat("/usr/lib/postgresql/" + pgClusterVersion + "/bin/initdb"); err != nil {
		t.Skipf("PostgreSQL %s's server is not installed: %v", pgClusterVersion, err)
	}
	dropAbandonedClusters(t)
	var b [4]byte
	_, _ = rand.Read(b[:])
	c := &pgCluster{t: t, name: fmt.Sprintf("%s%d_%s", pgClusterPrefix, os.Getpid(), hex.EncodeToString(b[:])), port: freePort(t)}
	out, err := exec.Command("pg_createcluster", pgClusterVersion, c.name, "--port", strconv.Itoa(c.port),
		"--start-conf=manual", // never started by the init scripts
		"-o", "fsync=on", "-o", "synchronous_commit=on", "-o", "full_page_writes=on",
		"--", "--auth=trust").CombinedOutput()
	if err != nil {
		// Not root (nor the owner of /etc/postgresql): "you might need
		// to run this program with root privileges".
		if s := strings.ToLower(string(out)); strings.Contains(s, "permission") || strings.Contains(s, "privileges") || strings.Contains(s, "not permitted") {
			t.Skipf("cannot create a PostgreSQL cluster here: %v: %s", err, out)
		}
		// It may exist partly: drop what there is.
		_ = exec.Command("pg_dropcluster", "--stop", pgClusterVersion, c.name).Run()
		t.Fatalf("pg_createcluster %s %s: %v\n%s", pgClusterVersion, c.name, err, out)
	}
	t.Cleanup(func() {
		if t.Failed() {
			if log, err := exec.Command("tail", "-n", "60", c.logFile()).CombinedOutput(); err == nil {
				t.Logf("cluster %s log (tail):\n%s", c.name, log)
			}
		}
		if out, err := exec.Command("pg_dropcluster", "--stop", pgClusterVersion, c.name).CombinedOutput(); err != nil {
			t.Errorf("pg_dropcluster --stop %s %s: %v\n%s", pgClusterVersion, c.name, err, out)
		}
	})
	c.ctl("start")
	return c
}

// pgClusterPrefix starts the name of every cluster newPGCluster creates;
// the creating process's id follows.
const pgClusterPrefix = "eventline_pgcrash_"

// dropAbandonedClusters drops the clusters of test processes that died
// without their cleanup (killed, or panicked on -timeout).
func dropAbandonedClusters(t *testing.T) {
	entries, err := os.ReadDir("/etc/postgresql/" + pgClusterVersion)
	if err != nil {
		return
	}
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), pgClusterPrefix)
		if !ok {
			continue
		}
		pidText, _, _ := strings.Cut(rest, "_")
		pid, err := strconv.Atoi(pidText)
		if err != nil || pid <= 0 || syscall.Kill(pid, 0) != syscall.ESRCH {
			continue // not ours, or its process lives
		}
		if out, err := exec.Command("pg_dropcluster", "--stop", pgClusterVersion, e.Name()).CombinedOutput(); err != nil {
			t.Logf("drop abandoned cluster %s: %v: %s", e.Name(), err, out)
		} else {
			t.Logf("dropped abandoned cluster %s (process %d is gone)", e.Name(), pid)
		}
	}
}

// freePort returns a TCP port nobody listens on at the moment.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func (c *pgCluster) logFile() string {
	return fmt.Sprintf("/var/log/postgresql/postgresql-%s-%s.log", pgClusterVersion, c.name)
}

// ctl runs pg_ctlcluster with an action (start, stop, restart) and its
// options; it returns when the action is done (a start: the server accepts
// connections).
func (c *pgCluster) ctl(action string, opts ...string) {
	c.t.Helper()
	args := append([]string{pgClusterVersion, c.name, action}, opts...)
	out, err := exec.Command("pg_ctlcluster", args...).CombinedOutput()
	require.NoError(c.t, err, "pg_ctlcluster %s: %s", strings.Join(args, " "), out)
}

// crash restarts the cluster in immediate mode: every server process is
// killed without a checkpoint (as in a crash), and the restart replays the
// WAL.
func (c *pgCluster) crash() { c.ctl("restart", "-m", "immediate") }

// url is the URL of a database of the cluster.
func (c *pgCluster) url(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", c.port, db)
}

// createDatabase creates a database in the cluster and returns its URL.
func (c *pgCluster) createDatabase(name string) string {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, c.url("postgres"))
	require.NoError(c.t, err)
	defer conn.Close(ctx)
	var fsync string
	require.NoError(c.t, conn.QueryRow(ctx, `SHOW fsync`).Scan(&fsync))
	require.Equal(c.t, "on", fsync, "the crash test needs durable commits")
	_, err = conn.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{name}.Sanitize())
	require.NoError(c.t, err)
	return c.url(name)
}
