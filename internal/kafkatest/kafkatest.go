// Package kafkatest is eventline's one Kafka helper for tests, examples and
// TestMains: it gives a Kafka cluster in one of two modes, and the
// operations tests need on it (topics, topic configuration, records,
// faults).
//
// In-process mode, the default: franz-go's kfake, reached over TCP.
// Real-broker mode, when KAFKA_BROKERS is set (make test-kafka sets it to
// an Apache Kafka broker started by internal/kafkabroker): tests share that
// cluster, and a test that needs a broker of its own (to kill or freeze it,
// or to put a fault proxy in front of it) gets an Apache Kafka broker
// started for it alone.
//
// A test asks for what it needs, not for a mode:
//
//   - Brokers, Start: any Kafka (the shared one in real-broker mode).
//   - WithFaults: a Kafka behind a fault proxy (refuse, reset, freeze): kfake
//     behind the proxy, or a broker of its own that advertises the proxy's
//     address (clients reconnect to what metadata advertises).
//   - NeedReal, then Start with Config.Faults: an Apache Kafka broker of its
//     own (Cluster.Broker) to kill, freeze and restart; NeedReal skips the
//     test in in-process mode.
//   - Fake: kfake always, for what only kfake can do (Cluster.ControlKey).
//
// Like a production cluster, no cluster here creates a topic on first use
// unless asked (Config.AutoCreateTopics, kfake only).
//
// eventlinetest/kafkatest, the public test kit, and the examples' setup are
// thin layers over this package.
package kafkatest

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkabroker"
	"github.com/eventline/eventline/internal/kafkaconf"
)

// BrokersEnv names the environment variable that selects real-broker mode:
// a comma-separated host:port list of the cluster to use.
const BrokersEnv = kafkaconf.BrokersEnv

// DefaultPartitions is the partition count of topics created without one.
const DefaultPartitions = 4

// Real reports whether real-broker mode is on (KAFKA_BROKERS is set).
func Real() bool { return len(kafkaconf.BrokersFromEnv()) > 0 }

// Config says which cluster New starts or joins. The zero value joins the
// shared cluster in real-broker mode and starts kfake otherwise.
type Config struct {
	// Brokers joins this cluster, as a shared one, instead of the one
	// KAFKA_BROKERS names (or kfake when it is unset).
	Brokers []string
	// Topics are created (Partitions each) before New returns.
	Topics []string
	// Partitions is the partition count of topics created without one.
	// Defaults to DefaultPartitions.
	Partitions int32
	// InProcess starts kfake even in real-broker mode.
	InProcess bool
	// Own gives the caller a cluster of its own: kfake, or in real-broker
	// mode an Apache Kafka broker started for it (Broker), never the shared
	// cluster.
	Own bool
	// Faults puts a fault proxy (Proxy) in front of the cluster. It
	// implies Own.
	Faults bool
	// Persist keeps kfake's state in a directory, so that Restart after
	// Crash finds the topics and records, as Apache Kafka does.
	Persist bool
	// AutoCreateTopics lets kfake create a topic on first use. The Apache
	// Kafka brokers started here never do.
	AutoCreateTopics bool
	// FakeOptions are passed to kfake.NewCluster.
	FakeOptions []kfake.Opt
}

// Cluster is a Kafka cluster for a test, an example or a TestMain.
type Cluster struct {
	// Brokers are the bootstrap addresses to give clients (the proxy's,
	// with Faults).
	Brokers []string
	// Fake is the in-process cluster; nil in real-broker mode.
	Fake *kfake.Cluster
	// Broker is the Apache Kafka broker started for this cluster alone
	// (Own or Faults in real-broker mode); nil otherwise.
	Broker *kafkabroker.Broker
	// Proxy is the fault proxy in front of the cluster (Faults); nil
	// otherwise.
	Proxy *faultproxy.Proxy

	cfg      Config
	fakeOpts []kfake.Opt
	fakePort int    // kfake's listener port (behind the proxy, with Faults)
	fakeDir  string // kfake's state (Persist)

	mu      sync.Mutex
	created []string // topics to delete on Close, on the shared cluster
	groups  []string // groups to delete on Close, on the shared cluster
	release func()   // gives back the own-broker slot
	closed  bool
}

// New starts or joins a cluster as cfg says. Close it when done.
func New(ctx context.Context, cfg Config) (*Cluster, error) {
	if cfg.Partitions <= 0 {
		cfg.Partitions = DefaultPartitions
	}
	c := &Cluster{cfg: cfg}
	var err error
	switch {
	case len(cfg.Brokers) > 0:
		c.Brokers = cfg.Brokers
	case !Real() || cfg.InProcess:
		err = c.startFake()
	case cfg.Own || cfg.Faults:
		err = c.startBroker(ctx)
	default:
		c.Brokers = kafkaconf.BrokersFromEnv()
	}
	if err == nil {
		err = c.CreateTopics(ctx, cfg.Partitions, cfg.Topics...)
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// InProcess reports whether the cluster is kfake.
func (c *Cluster) InProcess() bool { return c.Fake != nil }

// Close stops what New started (kfake, a broker of its own, the proxy),
// or on the shared cluster deletes the topics and groups created through
// this Cluster. It is safe to call twice.
func (c *Cluster) Close() {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	topics, groups, release := c.created, c.groups, c.release
	c.mu.Unlock()
	switch {
	case c.Fake != nil:
		c.Fake.Close()
		if c.fakeDir != "" {
			_ = os.RemoveAll(c.fakeDir)
		}
	case c.Broker != nil:
		_ = c.Broker.Stop()
	case c.Brokers != nil && len(topics)+len(groups) > 0:
		c.deleteOnClose(topics, groups)
	}
	if c.Proxy != nil {
		_ = c.Proxy.Close()
	}
	if release != nil {
		release()
	}
}

// startFake starts kfake, behind the proxy with Faults.
func (c *Cluster) startFake() error {
	c.fakeOpts = []kfake.Opt{kfake.NumBrokers(1), kfake.DefaultNumPartitions(int(c.cfg.Partitions))}
	if c.cfg.AutoCreateTopics {
		c.fakeOpts = append(c.fakeOpts, kfake.AllowAutoTopicCreation())
	}
	if c.cfg.Persist {
		dir, err := os.MkdirTemp("", "eventline-kfake-")
		if err != nil {
			return fmt.Errorf("kafkatest: %w", err)
		}
		c.fakeDir = dir
		c.fakeOpts = append(c.fakeOpts, kfake.DataDir(dir))
	}
	if c.cfg.Faults {
		c.fakeOpts = append(c.fakeOpts, kfake.ListenFn(c.listenBehindProxy))
	}
	c.fakeOpts = append(c.fakeOpts, c.cfg.FakeOptions...)
	return c.runFake(0)
}

func (c *Cluster) runFake(port int) error {
	opts := c.fakeOpts
	if port != 0 {
		opts = append([]kfake.Opt{kfake.Ports(port)}, opts...)
	}
	f, err := kfake.NewCluster(opts...)
	if err != nil {
		return fmt.Errorf("kafkatest: start the in-process Kafka (kfake): %w", err)
	}
	c.Fake = f
	c.Brokers = f.ListenAddrs()
	if c.Proxy == nil {
		_, p, _ := net.SplitHostPort(c.Brokers[0])
		c.fakePort, _ = strconv.Atoi(p)
	}
	return nil
}

// listenBehindProxy is kfake's listen function with Faults: kfake listens
// on a free port, the proxy forwards to it, and the listener reports the
// proxy's address, which kfake then advertises in its metadata. The proxy
// is started once and kept across a Restart.
func (c *Cluster) listenBehindProxy(network, address string) (net.Listener, error) {
	if c.Proxy != nil && c.fakePort != 0 {
		address = net.JoinHostPort("127.0.0.1", strconv.Itoa(c.fakePort)) // Restart: where the proxy forwards
	}
	ln, err := net.Listen(network, address)
	if err != nil {
		return nil, err
	}
	if c.Proxy == nil {
		p, err := faultproxy.Start(ln.Addr().String())
		if err != nil {
			_ = ln.Close()
			return nil, err
		}
		c.Proxy = p
		c.fakePort = ln.Addr().(*net.TCPAddr).Port
	}
	return &proxiedListener{Listener: ln, addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: c.Proxy.Port()}}, nil
}

// proxiedListener is kfake's listener, reporting the proxy's address.
type proxiedListener struct {
	net.Listener
	addr net.Addr
}

func (l *proxiedListener) Addr() net.Addr { return l.addr }
