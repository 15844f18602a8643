// Package faultproxy is a TCP proxy for fault tests: it forwards
// connections to a target (PostgreSQL, a Kafka broker) and, on command,
// refuses new connections, drops every open one, or freezes them: bytes
// stop flowing in both directions while the sockets stay open, the way a
// vanished host, a network partition or a paused VM looks to its peer.
//
// It never touches the server behind it, so tests can cut one client off a
// shared PostgreSQL without disturbing anybody else.
package faultproxy

import (
	"net"
	"sync"
	"time"
)

// Mode is what the proxy does with traffic.
type Mode int

// The proxy's modes.
const (
	// Pass forwards everything.
	Pass Mode = iota
	// Refuse closes new connections as soon as they are accepted; open
	// ones keep working until Drop. Clients see "connection reset" or EOF
	// on connect, as when a server restarts.
	Refuse
	// Freeze stops forwarding bytes on every connection, open and new,
	// without closing any: reads and writes on the client side block until
	// its own timeouts fire. Switching back to Pass resumes the flow.
	Freeze
)

// Proxy forwards TCP connections from Addr to a target.
type Proxy struct {
	target string
	ln     net.Listener

	mu     sync.Mutex
	mode   Mode
	resume chan struct{} // closed when leaving Freeze
	conns  map[*link]struct{}
	closed bool
	// refused counts connections closed at once in Refuse mode.
	refused int64
	wg      sync.WaitGroup
}

type link struct{ client, server net.Conn }

func (l *link) close() {
	_ = l.client.Close()
	_ = l.server.Close()
}

// Start listens on a free port of 127.0.0.1 and forwards to target
// (host:port). Close it when done.
func Start(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	return Serve(ln, target), nil
}

// Serve is Start on a listener of the caller's: one opened before the
// target was known, whose address the target had to be told (a Kafka
// broker advertising the proxy). Close closes ln.
func Serve(ln net.Listener, target string) *Proxy {
	p := &Proxy{target: target, ln: ln, resume: make(chan struct{}), conns: map[*link]struct{}{}}
	close(p.resume)
	p.wg.Add(1)
	go p.accept()
	return p
}

// Addr is the proxy's listening address, host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port is the proxy's listening port.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Set switches the mode. Leaving Freeze resumes the frozen connections.
func (p *Proxy) Set(m Mode) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mode == m {
		return
	}
	if m == Freeze {
		p.resume = make(chan struct{})
	} else if p.mode == Freeze {
		close(p.resume)
	}
	p.mode = m
}

// Mode returns the current mode.
func (p *Proxy) Mode() Mode {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mode
}

// Drop closes every open connection (both sides), as a server crash or a
// reset does. The mode is unchanged.
func (p *Proxy) Drop() {
	p.mu.Lock()
	conns := p.conns
	p.conns = map[*link]struct{}{}
	p.mu.Unlock()
	for l := range conns {
		l.close()
	}
}

// Conns returns the number of open proxied connections.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// Refused returns how many connections were refused (closed as soon as
// accepted in Refuse mode) so far: how often clients tried to reconnect.
func (p *Proxy) Refused() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.refused
}

// Close stops listening, closes every connection and waits for the
// proxy's goroutines.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	if p.mode == Freeze {
		close(p.resume)
		p.mode = Pass
	}
	p.mu.Unlock()
	err := p.ln.Close()
	p.Drop()
	p.wg.Wait()
	return err
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse := p.mode == Refuse || p.closed
		if refuse {
			p.refused++
		}
		p.mu.Unlock()
		if refuse {
			_ = c.Close()
			continue
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

func (p *Proxy) serve(c net.Conn) {
	defer p.wg.Done()
	s, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		_ = c.Close()
		return
	}
	l := &link{client: c, server: s}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		l.close()
		return
	}
	p.conns[l] = struct{}{}
	p.mu.Unlock()

	done := make(chan struct{}, 2)
	p.wg.Add(2)
	go func() { defer p.wg.Done(); p.pipe(s, c); done <- struct{}{} }()
	go func() { defer p.wg.Done(); p.pipe(c, s); done <- struct{}{} }()
	<-done
	l.close()
	p.mu.Lock()
	delete(p.conns, l)
	p.mu.Unlock()
}

// pipe copies src to dst, holding every chunk while the proxy is frozen.
func (p *Proxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.waitThaw()
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// waitThaw blocks while the proxy is frozen.
func (p *Proxy) waitThaw() {
	p.mu.Lock()
	ch := p.resume
	p.mu.Unlock()
	<-ch
}
