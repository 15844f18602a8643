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
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

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
