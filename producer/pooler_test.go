package producer_test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/producer"
)

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
