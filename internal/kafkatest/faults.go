package kafkatest

import (
	"net"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/eventline/eventline/internal/devkafka"
	"github.com/eventline/eventline/internal/faultproxy"
)

// Faults sits between a kfake cluster and its clients: every connection
// the cluster accepts (bootstrap and advertised broker address alike, they
// are the same listener) goes through it, so a test can take the whole
// broker away while clients are connected and bring it back, the way a
// broker crash, a network partition or a paused VM looks to a client. Its
// modes are faultproxy's:
//
//   - faultproxy.Pass serves every connection.
//   - faultproxy.Refuse closes new connections as soon as they are
//     accepted; open ones keep working until Drop.
//   - faultproxy.Freeze stops the broker reading and writing on every
//     connection, open and new, without closing any: clients connect (the
//     kernel accepts) but are never answered, and their requests time out
//     on their side. Switching back to Pass resumes the flow; what a client
//     sent meanwhile is then read.
type Faults struct {
	mu      sync.Mutex
	mode    faultproxy.Mode
	resume  chan struct{} // closed when leaving Freeze
	conns   map[*faultConn]struct{}
	refused int64
	closed  chan struct{} // closed when the cluster's listeners are all closed
	lns     int
}

// FakeWithFaults starts a kfake cluster, like Fake, whose connections go
// through the returned Faults.
func FakeWithFaults(t testing.TB, opts ...kfake.Opt) (*kfake.Cluster, []string, *Faults) {
	t.Helper()
	f := &Faults{resume: make(chan struct{}), conns: map[*faultConn]struct{}{}, closed: make(chan struct{})}
	close(f.resume)
	opts = append([]kfake.Opt{kfake.ListenFn(f.listen)}, opts...)
	c, err := devkafka.Start(0, opts...)
	require.NoError(t, err)
	t.Cleanup(func() {
		f.Set(faultproxy.Pass) // let frozen connections see the cluster close
		c.Close()
	})
	return c, c.ListenAddrs(), f
}

// Set switches the mode. Leaving Freeze resumes the frozen connections.
func (f *Faults) Set(m faultproxy.Mode) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.mode == m {
		return
	}
	if m == faultproxy.Freeze {
		f.resume = make(chan struct{})
	} else if f.mode == faultproxy.Freeze {
		close(f.resume)
	}
	f.mode = m
}

// Mode returns the current mode.
func (f *Faults) Mode() faultproxy.Mode {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.mode
}

// Drop closes every open client connection, as a broker crash does. The
// mode is unchanged.
func (f *Faults) Drop() {
	f.mu.Lock()
	conns := f.conns
	f.conns = map[*faultConn]struct{}{}
	f.mu.Unlock()
	for c := range conns {
		_ = c.Close()
	}
}

// Conns returns the number of open client connections.
func (f *Faults) Conns() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.conns)
}

// Refused returns how many connections were closed as soon as accepted in
// Refuse mode so far: how often clients tried to reconnect.
func (f *Faults) Refused() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.refused
}

// listen is the cluster's ListenFn.
func (f *Faults) listen(network, address string) (net.Listener, error) {
	ln, err := net.Listen(network, address)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.lns++
	f.mu.Unlock()
	return &faultListener{Listener: ln, f: f}, nil
}

// thawed returns a channel closed once the connections may flow.
func (f *Faults) thawed() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.resume
}

type faultListener struct {
	net.Listener
	f    *Faults
	once sync.Once
}

func (l *faultListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		f := l.f
		f.mu.Lock()
		if f.mode == faultproxy.Refuse {
			f.refused++
			f.mu.Unlock()
			_ = c.Close()
			continue
		}
		fc := &faultConn{Conn: c, f: f, done: make(chan struct{})}
		f.conns[fc] = struct{}{}
		f.mu.Unlock()
		return fc, nil
	}
}

func (l *faultListener) Close() error {
	err := l.Listener.Close()
	l.once.Do(func() {
		l.f.mu.Lock()
		defer l.f.mu.Unlock()
		if l.f.lns--; l.f.lns == 0 {
			close(l.f.closed)
		}
	})
	return err
}

// faultConn is the broker's side of a client connection: its reads and
// writes wait while the Faults are frozen.
type faultConn struct {
	net.Conn
	f    *Faults
	once sync.Once
	done chan struct{} // closed by Close
}

// wait blocks while frozen; false when the connection or the cluster's
// listeners closed meanwhile.
func (c *faultConn) wait() bool {
	select {
	case <-c.f.thawed():
		return true
	case <-c.done:
		return false
	case <-c.f.closed:
		return false
	}
}

func (c *faultConn) Read(b []byte) (int, error) {
	if !c.wait() {
		return 0, net.ErrClosed
	}
	n, err := c.Conn.Read(b)
	if n > 0 && !c.wait() { // read while frozen: hold it until the thaw
		return 0, net.ErrClosed
	}
	return n, err
}

func (c *faultConn) Write(b []byte) (int, error) {
	if !c.wait() {
		return 0, net.ErrClosed
	}
	return c.Conn.Write(b)
}

func (c *faultConn) Close() error {
	c.once.Do(func() {
		close(c.done)
		c.f.mu.Lock()
		delete(c.f.conns, c)
		c.f.mu.Unlock()
	})
	return c.Conn.Close()
}
