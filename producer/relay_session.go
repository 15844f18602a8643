package producer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/outbox"
)

// probeTimeout bounds the wait for the listener's own probe notification.
const probeTimeout = 2 * time.Second

// prepareSession asks PostgreSQL to end the relay's long-lived sessions
// itself when the relay's host stops answering, instead of keeping them
// (and what they hold) until the operating system's TCP keepalive gives up
// after about two hours: keepalive probes after a few seconds of silence,
// unacknowledged data dropped after tcp_user_timeout, and, on the
// ownership connection, idle_session_timeout. Settings the server does not
// know (older versions) are skipped. It also adds the relay's identity to
// the session's application_name (relayAppName), which the server reports
// to the client whenever it changes, so reading it costs no round trip.
func (r *Relay) prepareSession(ctx context.Context, conn *pgx.Conn, ownership bool) error {
	name := conn.PgConn().ParameterStatus("application_name")
	secs := max(1, int(r.cfg.RebalanceInterval.Round(time.Second)/time.Second))
	settings := [][2]string{
		{"application_name", relayAppName(name)},
		{"tcp_keepalives_idle", strconv.Itoa(secs)},
		{"tcp_keepalives_interval", strconv.Itoa(secs)},
		{"tcp_keepalives_count", "3"},
		{"tcp_user_timeout", strconv.FormatInt(r.leaseTTL().Milliseconds(), 10)},
	}
	if ownership {
		// The ownership connection runs a statement every interval.
		settings = append(settings, [2]string{"idle_session_timeout", strconv.FormatInt((r.leaseTTL() + r.cfg.RebalanceInterval).Milliseconds(), 10)})
	}
	names, values := make([]string, len(settings)), make([]string, len(settings))
	for i, s := range settings {
		names[i], values[i] = s[0], s[1]
	}
	_, err := conn.Exec(ctx, `SELECT set_config(v.name, v.value, false)
		FROM unnest($1::text[], $2::text[]) AS v(name, value)
		WHERE EXISTS (SELECT 1 FROM pg_settings s WHERE s.name = v.name)`, names, values)
	if err != nil {
		return fmt.Errorf("configure relay session: %w", err)
	}
	return nil
}

// relayIdentity names the relay's sessions in pg_stat_activity.
const relayIdentity = "eventline-relay"

// maxAppNameBytes is the longest application_name PostgreSQL keeps
// (NAMEDATALEN - 1); pg_stat_activity cuts longer ones.
const maxAppNameBytes = 63

// relayAppName returns the application_name of a relay session whose pool
// named it name: the operator's name with the relay's identity added
// ("billing-svc (eventline-relay)"), so pg_stat_activity still tells the
// services apart and shows which of a service's sessions are its relay's.
// The operator's name is cut (at a character boundary) so the whole fits
// in PostgreSQL's 63 bytes; without one it is "eventline-relay". A name
// that already ends with the identity is kept as it is.
func relayAppName(name string) string {
	const suffix = " (" + relayIdentity + ")"
	name = strings.TrimSpace(name)
	switch {
	case name == "", name == relayIdentity:
		return relayIdentity
	case strings.HasSuffix(name, suffix) && len(name) <= maxAppNameBytes:
		return name
	}
	limit := maxAppNameBytes - len(suffix)
	if len(name) > limit {
		cut := limit
		for cut > 0 && !utf8.RuneStart(name[cut]) {
			cut--
		}
		name = strings.TrimSpace(name[:cut])
		if name == "" {
			return relayIdentity
		}
	}
	return name + suffix
}

// listen wakes idle shards when their tables get rows: every outbox table
// NOTIFYs "<schema>.<shard>" on insert (while its relay waits). After a
// reconnect it wakes every shard, since notifications may have been
// missed. It checks the connection every RebalanceInterval while no
// notification arrives, so a connection that stopped answering is noticed
// and replaced.
//
// On its first connection it sends itself a notification and returns
// ErrSessionPooling (through ready and as its result) if it never arrives;
// ready gets nil once the listener works.
func (r *Relay) listen(ctx context.Context, ready chan<- error) error {
	prefix := r.cfg.Schema + "."
	first := true
	for ctx.Err() == nil {
		conn, err := r.pool.Acquire(ctx)
		if err != nil {
			_ = backoff.Sleep(ctx, time.Second)
			continue
		}
		err = r.startListening(ctx, conn.Conn(), first)
		if errors.Is(err, ErrSessionPooling) {
			closeConn(conn)
			ready <- err
			return err
		}
		if err == nil && first {
			first = false
			ready <- nil
		}
		r.wakeAll()
		for err == nil {
			var n *pgconn.Notification
			n, err = r.awaitNotification(ctx, conn.Conn(), r.cfg.RebalanceInterval)
			if n != nil && strings.HasPrefix(n.Payload, prefix) {
				if shard, convErr := strconv.Atoi(n.Payload[len(prefix):]); convErr == nil {
					r.wake(shard)
				}
			}
		}
		if ctx.Err() == nil {
			r.log.Debug("outbox listener reconnecting", "err", err)
		}
		// A connection that was listening is closed, not returned to the
		// pool, so no other user inherits the LISTEN.
		closeConn(conn)
		_ = backoff.Sleep(ctx, 100*time.Millisecond)
	}
	if first {
		ready <- nil
	}
	return nil
}

// startListening prepares conn and LISTENs on it. With probe set it also
// checks that a notification sent from another connection arrives: behind
// a transaction-mode pooler the LISTEN stays on a server connection the
// listener does not hold, and the notification never comes.
func (r *Relay) startListening(ctx context.Context, conn *pgx.Conn, probe bool) error {
	sctx, cancel := context.WithTimeout(ctx, r.cfg.RebalanceInterval+probeTimeout)
	defer cancel()
	var serverPID uint32
	if err := conn.QueryRow(sctx, `SELECT pg_backend_pid()`).Scan(&serverPID); err != nil {
		return err
	}
	pooled := serverPID != conn.PgConn().PID()
	if !pooled {
		// Through a pooler these would be set on a server connection
		// others may get.
		if err := r.prepareSession(sctx, conn, false); err != nil {
			return err
		}
	}
	if _, err := conn.Exec(sctx, `LISTEN `+outbox.NotifyChannel); err != nil {
		return err
	}
	if !probe {
		return nil
	}
	var token [8]byte
	_, _ = rand.Read(token[:])
	payload := r.cfg.Schema + ".probe." + hex.EncodeToString(token[:])
	if _, err := r.pool.Exec(sctx, `SELECT pg_notify($1, $2)`, outbox.NotifyChannel, payload); err != nil {
		return err
	}
	deadline := time.Now().Add(probeTimeout)
	if d, _ := sctx.Deadline(); d.Before(deadline) {
		deadline = d
	}
	for {
		n, err := r.awaitNotification(ctx, conn, time.Until(deadline))
		if err != nil {
			return err
		}
		if n == nil {
			// Silence, though the connection answers: pooling.
			return fmt.Errorf("%w (a notification the relay sent itself never reached its LISTEN connection)", ErrSessionPooling)
		}
		if n.Payload == payload {
			break
		}
	}
	if pooled {
		r.log.Info("the relay's connections go through a connection pooler; relays need it in session mode", "client_side_pid", conn.PgConn().PID(), "server_pid", serverPID)
	}
	return nil
}

// awaitNotification waits at most d for a notification on conn. When none
// comes, it checks that the connection still answers, and returns neither
// a notification nor an error if it does.
func (r *Relay) awaitNotification(ctx context.Context, conn *pgx.Conn, d time.Duration) (*pgconn.Notification, error) {
	wctx, cancel := context.WithTimeout(ctx, d)
	n, err := conn.WaitForNotification(wctx)
	cancel()
	if err == nil || ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) {
		return n, err
	}
	pctx, cancel := context.WithTimeout(ctx, r.cfg.RebalanceInterval)
	defer cancel()
	return nil, conn.Ping(pctx)
}
