package middleware_test

import (
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// latencyProxy forwards TCP connections to target, delivering every chunk
// rtt/2 after it was read, in each direction, so a client on the same host
// sees the round-trip time of a database on another host. Pipelined chunks
// overlap, as on a real link. It stops when the test ends.
func latencyProxy(t testing.TB, target string, rtt time.Duration) (addr string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Errorf("latency proxy: %v", err)
		t.FailNow()
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	track := func(c net.Conn) {
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", target)
			if err != nil {
				client.Close()
				continue
			}
			track(client)
			track(server)
			wg.Add(2)
			go func() { defer wg.Done(); delayCopy(server, client, rtt/2) }()
			go func() { defer wg.Done(); delayCopy(client, server, rtt/2) }()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

type chunk struct {
	data []byte
	due  time.Time
}

// delayCopy copies src to dst, holding each chunk for delay.
func delayCopy(dst, src net.Conn, delay time.Duration) {
	ch := make(chan chunk, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for c := range ch {
			if d := time.Until(c.due); d > 0 {
				time.Sleep(d)
			}
			if _, err := dst.Write(c.data); err != nil {
				src.Close()
				for range ch {
				}
				return
			}
		}
		if tc, ok := dst.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			ch <- chunk{data: append([]byte(nil), buf[:n]...), due: time.Now().Add(delay)}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				dst.Close()
			}
			break
		}
	}
	close(ch)
	<-done
}
