package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkabroker"
)

// OwnBrokersEnv names the environment variable bounding how many Apache
// Kafka brokers of their own the tests run at once on this machine, across
// test processes (each JVM takes about 150-300 MiB and a core-second or
// more to start). Defaults to defaultOwnBrokers.
const OwnBrokersEnv = "EVENTLINE_KAFKA_OWN_BROKERS"

const defaultOwnBrokers = 3

// startBroker starts an Apache Kafka broker for this cluster alone, behind
// a fault proxy with Faults.
func (c *Cluster) startBroker(ctx context.Context) error {
	release, err := ownSlot(ctx)
	if err != nil {
		return err
	}
	c.release = release
	var cfg kafkabroker.Config
	var proxy net.Listener
	if c.cfg.Faults {
		// The broker advertises the proxy's address, so the proxy's
		// listener comes first; it forwards once the broker listens.
		if proxy, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			return fmt.Errorf("kafkatest: start the fault proxy: %w", err)
		}
		cfg.Advertise = proxy.Addr().String()
	}
	b, err := kafkabroker.Start(ctx, cfg)
	if err != nil {
		if proxy != nil {
			_ = proxy.Close()
		}
		return fmt.Errorf("kafkatest: %w", err)
	}
	c.Broker, c.Brokers = b, []string{b.Addr()}
	if proxy != nil {
		c.Proxy = faultproxy.Serve(proxy, b.ListenAddr())
	}
	return nil
}

// ownSlot takes one of the machine's own-broker slots (flock on a file per
// slot under the brokers' state directory), waiting for one to free up.
func ownSlot(ctx context.Context) (release func(), err error) {
	n := defaultOwnBrokers
	if s := os.Getenv(OwnBrokersEnv); s != "" {
		if n, err = strconv.Atoi(s); err != nil || n < 1 {
			return nil, fmt.Errorf("kafkatest: %s must be a positive number, got %q", OwnBrokersEnv, s)
		}
	}
	dir := filepath.Join(os.TempDir(), "eventline-kafka")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("kafkatest: %w", err)
	}
	for {
		for i := range n {
			f, err := os.OpenFile(filepath.Join(dir, fmt.Sprintf("slot-%d.lock", i)), os.O_CREATE|os.O_RDWR, 0o644)
			if err != nil {
				return nil, fmt.Errorf("kafkatest: %w", err)
			}
			if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err == nil {
				return func() { _ = f.Close() }, nil // closing releases the lock
			} else if !errors.Is(err, syscall.EWOULDBLOCK) {
				_ = f.Close()
				return nil, fmt.Errorf("kafkatest: lock a broker slot: %w", err)
			}
			_ = f.Close()
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("kafkatest: no broker slot free (%d in use; %s): %w", n, OwnBrokersEnv, context.Cause(ctx))
		case <-time.After(200 * time.Millisecond): // polling interval
		}
	}
}

// Crash takes the cluster down at once, as a crash does: the broker's JVM
// is killed (SIGKILL), or kfake is closed. Restart brings it back with its
// data (kfake needs Config.Persist). Only for a cluster of its own.
func (c *Cluster) Crash() error {
	switch {
	case c.Broker != nil:
		return c.Broker.Kill()
	case c.Fake != nil:
		c.Fake.Close()
		return nil
	}
	return errors.New("kafkatest: Crash needs a cluster of its own (Config.Own)")
}

// Restart starts the cluster again after Crash, on the same address and
// data, and waits until it answers.
func (c *Cluster) Restart(ctx context.Context) error {
	switch {
	case c.Broker != nil:
		if err := c.Broker.Restart(ctx); err != nil {
			return fmt.Errorf("kafkatest: %w", err)
		}
		return nil
	case c.Fake != nil:
		if c.fakeDir == "" {
			return errors.New("kafkatest: restarting kfake keeps nothing without Config.Persist")
		}
		port := c.fakePort
		if c.Proxy != nil {
			port = 0 // listenBehindProxy binds where the proxy forwards
		}
		var err error
		for range 50 { // the old listener's port may linger a moment
			if err = c.runFake(port); err == nil {
				return nil
			}
			select {
			case <-ctx.Done():
				return err
			case <-time.After(100 * time.Millisecond):
			}
		}
		return err
	}
	return errors.New("kafkatest: Restart needs a cluster of its own (Config.Own)")
}
