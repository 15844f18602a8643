// Package kafkabroker runs Apache Kafka for eventline's tests and for
// development: a single-node KRaft broker (combined broker and controller)
// on 127.0.0.1, in its own JVM, data in a temporary directory. Kafka and its
// runtime dependencies come from Maven Central through the checked-in
// pom.xml, cached in .cache/kafka (see Jars).
//
// A test can kill the broker (SIGKILL), freeze it (SIGSTOP) and resume it,
// and restart it on the same data directory, and can have it advertise
// another address than its listener's, so that a fault proxy in front of it
// sees every connection (clients reconnect to what metadata advertises).
// The JVM dies with the process that started it, even one killed with
// SIGKILL (Linux's parent-death signal).
//
// It needs Java 17 or newer (java on PATH, or JAVA_HOME) and, the first
// time, Maven with Maven Central reachable.
package kafkabroker

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/IBM/sarama"
)

// DefaultHeap is the JVM's maximum heap (-Xmx) unless Config.Heap says
// otherwise: enough for the tests' traffic.
const DefaultHeap = "512m"

// startTimeout bounds how long Start and Restart wait for the broker to
// answer metadata requests.
const startTimeout = 2 * time.Minute

// stopTimeout is how long Stop waits for a clean shutdown before SIGKILL.
const stopTimeout = 30 * time.Second

// Config tunes Start. The zero value starts a broker on free ports.
type Config struct {
	// Port is the client listener's port on 127.0.0.1. 0 picks a free one.
	Port int
	// Advertise is the host:port the broker tells clients to connect to
	// (advertised.listeners): a fault proxy's address, say. Empty means the
	// client listener's own address.
	Advertise string
	// Heap is the JVM's -Xmx. Defaults to DefaultHeap.
	Heap string
	// LogLevel is the root level of the broker's server.log (in its
	// directory). Defaults to WARN.
	LogLevel string
}

// Broker is a running (or killed, or paused) Kafka broker.
type Broker struct {
	cfg      Config
	jars     string
	dir      string // root: server.properties, log4j2.properties, *.log, data/
	client   int    // client listener port
	internal int    // inter-broker listener port
	control  int    // controller listener port

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{} // closed when the current JVM exited
	waitErr error
	startup time.Duration
	removed bool
}

// Start resolves Kafka's jars (see Jars), formats a new data directory,
// starts the broker and waits until it answers metadata requests.
func Start(ctx context.Context, cfg Config) (*Broker, error) {
	if cfg.Heap == "" {
		cfg.Heap = DefaultHeap
	}
	if cfg.LogLevel == "" {
		cfg.LogLevel = "WARN"
	}
	if _, err := javaPath(); err != nil {
		return nil, err
	}
	jars, err := Jars(ctx)
	if err != nil {
		return nil, err
	}
	sweepStale()
	var lastErr error
	// A free port may be taken by another process before the JVM binds it:
	// pick new ones and try again (a given Port is kept).
	for range 3 {
		b, err := start(ctx, cfg, jars)
		if err == nil {
			return b, nil
		}
		lastErr = err
		if !errors.Is(err, errPortInUse) || ctx.Err() != nil {
			break
		}
	}
	return nil, lastErr
}

var errPortInUse = errors.New("a listener's port is already in use")

func start(ctx context.Context, cfg Config, jars string) (*Broker, error) {
	b := &Broker{cfg: cfg, jars: jars, client: cfg.Port}
	var err error
	if b.client == 0 {
		if b.client, err = freePort(); err != nil {
			return nil, err
		}
	}
	if b.internal, err = freePort(); err != nil {
		return nil, err
	}
	if b.control, err = freePort(); err != nil {
		return nil, err
	}
	if b.dir, err = newDir(); err != nil {
		return nil, err
	}
	if err := b.prepare(ctx); err != nil {
		_ = os.RemoveAll(b.dir)
		return nil, err
	}
	if err := b.launch(ctx); err != nil {
		_ = os.RemoveAll(b.dir)
		return nil, err
	}
	return b, nil
}

// prepare writes the configuration and a formatted data directory.
func (b *Broker) prepare(ctx context.Context) error {
	props := b.properties()
	if err := os.WriteFile(filepath.Join(b.dir, "server.properties"), []byte(props), 0o644); err != nil {
		return fmt.Errorf("kafkabroker: write server.properties: %w", err)
	}
	if err := os.WriteFile(filepath.Join(b.dir, "log4j2.properties"), []byte(b.log4j()), 0o644); err != nil {
		return fmt.Errorf("kafkabroker: write log4j2.properties: %w", err)
	}
	return formatStorage(ctx, b.jars, filepath.Join(b.dir, "data"))
}

// Addr is the address clients bootstrap from: Config.Advertise, or the
// client listener's.
func (b *Broker) Addr() string {
	if b.cfg.Advertise != "" {
		return b.cfg.Advertise
	}
	return b.ListenAddr()
}

// ListenAddr is the broker's client listener, host:port.
func (b *Broker) ListenAddr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(b.client)) }

// Dir is the broker's directory: its configuration, server.log, and the
// data directory (data/).
func (b *Broker) Dir() string { return b.dir }

// Pid is the JVM's process id.
func (b *Broker) Pid() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cmd.Process.Pid
}

// StartupTime is how long the last Start or Restart took from launching
// the JVM until the broker answered metadata requests.
func (b *Broker) StartupTime() time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.startup
}

// Kill ends the JVM with SIGKILL, as a crash does, and waits for it to
// exit. The data directory stays, for Restart.
func (b *Broker) Kill() error {
	b.mu.Lock()
	cmd, done := b.cmd, b.done
	b.mu.Unlock()
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("kafkabroker: kill the broker: %w", err)
	}
	<-done
	return nil
}

// Pause freezes the JVM (SIGSTOP): its sockets stay open and nothing
// answers, as with a long GC pause or a suspended VM.
func (b *Broker) Pause() error { return b.signal(syscall.SIGSTOP) }

// Resume lets a paused JVM run again (SIGCONT).
func (b *Broker) Resume() error { return b.signal(syscall.SIGCONT) }

func (b *Broker) signal(sig syscall.Signal) error {
	b.mu.Lock()
	cmd := b.cmd
	b.mu.Unlock()
	if err := cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("kafkabroker: send %v to the broker: %w", sig, err)
	}
	return nil
}

// Exited is closed when the current JVM (the last Start's or Restart's)
// has exited.
func (b *Broker) Exited() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.done
}

// Running reports whether the JVM is alive (possibly paused).
func (b *Broker) Running() bool {
	select {
	case <-b.Exited():
		return false
	default:
		return true
	}
}

// Restart starts the broker again on the same ports and data directory,
// after Kill (log recovery runs, as after a crash) or while it runs (it is
// stopped cleanly first), and waits until it answers.
func (b *Broker) Restart(ctx context.Context) error {
	if b.Running() {
		if err := b.shutdown(); err != nil {
			return err
		}
	}
	var err error
	// The old JVM's ports may linger a moment after it exited.
	for range 5 {
		if err = b.launch(ctx); !errors.Is(err, errPortInUse) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(time.Second):
		}
	}
	return err
}

// Stop shuts the broker down cleanly (SIGTERM; SIGKILL after 30 s), and
// removes its directory. It is safe to call more than once, and after Kill.
func (b *Broker) Stop() error {
	err := b.shutdown()
	b.mu.Lock()
	removed := b.removed
	b.removed = true
	b.mu.Unlock()
	if !removed {
		if rerr := os.RemoveAll(b.dir); rerr != nil && err == nil {
			err = fmt.Errorf("kafkabroker: remove %s: %w", b.dir, rerr)
		}
	}
	return err
}

// shutdown ends the JVM cleanly if it runs.
func (b *Broker) shutdown() error {
	b.mu.Lock()
	cmd, done := b.cmd, b.done
	b.mu.Unlock()
	if cmd == nil {
		return nil
	}
	select {
	case <-done:
		return nil
	default:
	}
	_ = cmd.Process.Signal(syscall.SIGCONT) // a paused JVM cannot shut down
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
		return nil
	case <-time.After(stopTimeout):
		_ = cmd.Process.Signal(syscall.SIGKILL)
		<-done
		return fmt.Errorf("kafkabroker: the broker did not stop within %s of SIGTERM; killed", stopTimeout)
	}
}

// LogTail returns the last n lines of the broker's server.log and of the
// JVM's own output, for failure messages.
func (b *Broker) LogTail(n int) string {
	var out strings.Builder
	for _, name := range []string{"server.log", "jvm.log"} {
		data, err := os.ReadFile(filepath.Join(b.dir, name))
		if err != nil || len(bytes.TrimSpace(data)) == 0 {
			continue
		}
		fmt.Fprintf(&out, "--- %s ---\n%s\n", name, tail(data, n))
	}
	return out.String()
}

// launch starts the JVM and waits until the broker answers.
func (b *Broker) launch(ctx context.Context) error {
	java, err := javaPath()
	if err != nil {
		return err
	}
	out, err := os.OpenFile(filepath.Join(b.dir, "jvm.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("kafkabroker: open jvm.log: %w", err)
	}
	defer out.Close() // the child has its own descriptor
	// Test traffic is light: the client compiler alone (TieredStopAtLevel=1)
	// and the serial collector start faster and stay smaller.
	args := []string{
		"-Xmx" + b.cfg.Heap, "-Xms64m", "-Xss512k",
		"-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:-UsePerfData", "-XX:+ExitOnOutOfMemoryError",
		"-Djava.awt.headless=true",
		"-Dlog4j2.configurationFile=" + filepath.Join(b.dir, "log4j2.properties"),
	}
	archive, dumping := classArchive(b.jars)
	args = append(args, archive,
		"-cp", filepath.Join(b.jars, "*"),
		"kafka.Kafka", filepath.Join(b.dir, "server.properties"))
	cmd := exec.Command(java, args...)
	cmd.Dir = b.dir
	cmd.Stdout, cmd.Stderr = out, out
	begin := time.Now()
	exited, err := startOwned(cmd)
	if err != nil {
		return fmt.Errorf("kafkabroker: start the JVM (%s): %w", java, err)
	}
	done := make(chan struct{})
	b.mu.Lock()
	b.cmd, b.done = cmd, done
	b.mu.Unlock()
	go func() {
		err := <-exited
		if dumping != "" {
			keepArchive(b.jars, dumping)
		}
		b.mu.Lock()
		b.waitErr = err
		b.mu.Unlock()
		close(done)
	}()
	if err := writeOwner(b.dir, cmd.Process.Pid); err != nil {
		_ = b.Kill()
		return err
	}
	if err := b.waitReady(ctx, done); err != nil {
		_ = b.Kill()
		return err
	}
	b.mu.Lock()
	b.startup = time.Since(begin)
	b.mu.Unlock()
	return nil
}

// waitReady waits until the client listener answers a metadata request
// that lists the broker, or the JVM exits, or the start timeout passes.
func (b *Broker) waitReady(ctx context.Context, done <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	cfg.ClientID = "eventline-kafkabroker"
	cfg.Net.DialTimeout = time.Second
	cfg.Net.ReadTimeout = 5 * time.Second
	cfg.Metadata.Retry.Max = 0
	for {
		select {
		case <-done:
			log := b.LogTail(30)
			if strings.Contains(log, "Address already in use") {
				return fmt.Errorf("kafkabroker: %w:\n%s", errPortInUse, log)
			}
			return fmt.Errorf("kafkabroker: the broker exited while starting (%v); its logs in %s:\n%s", b.exitErr(), b.dir, log)
		default:
		}
		if c, err := sarama.NewClient([]string{b.ListenAddr()}, cfg); err == nil {
			n := len(c.Brokers())
			_ = c.Close()
			if n > 0 {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kafkabroker: the broker did not answer within %s (%w); its logs in %s:\n%s", startTimeout, context.Cause(ctx), b.dir, b.LogTail(30))
		case <-done:
		case <-time.After(100 * time.Millisecond): // polling interval
		}
	}
}

func (b *Broker) exitErr() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.waitErr
}

// properties is the broker's server.properties.
func (b *Broker) properties() string {
	p := map[string]string{
		"process.roles":             "broker,controller",
		"node.id":                   "1",
		"controller.quorum.voters":  fmt.Sprintf("1@127.0.0.1:%d", b.control),
		"controller.listener.names": "CONTROLLER",
		// Clients use CLIENT, whose advertised address may be a proxy's;
		// the broker's own connections (INTERNAL, CONTROLLER) never go
		// through it, so a fault in front of the clients leaves the broker
		// itself healthy.
		"listeners": fmt.Sprintf("CLIENT://127.0.0.1:%d,INTERNAL://127.0.0.1:%d,CONTROLLER://127.0.0.1:%d",
			b.client, b.internal, b.control),
		"advertised.listeners":           fmt.Sprintf("CLIENT://%s,INTERNAL://127.0.0.1:%d", b.Addr(), b.internal),
		"listener.security.protocol.map": "CLIENT:PLAINTEXT,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
		"inter.broker.listener.name":     "INTERNAL",
		"log.dirs":                       filepath.Join(b.dir, "data"),
		// One node: every internal topic has one replica, and few
		// partitions so a first consumer group or transaction starts fast.
		"offsets.topic.replication.factor":                 "1",
		"offsets.topic.num.partitions":                     "4",
		"transaction.state.log.replication.factor":         "1",
		"transaction.state.log.min.isr":                    "1",
		"transaction.state.log.num.partitions":             "4",
		"share.coordinator.state.topic.replication.factor": "1",
		"share.coordinator.state.topic.min.isr":            "1",
		"share.coordinator.state.topic.num.partitions":     "1",
		"default.replication.factor":                       "1",
		"min.insync.replicas":                              "1",
		"num.partitions":                                   "1",
		// Like a production cluster, and like eventline's kfake clusters:
		// a topic must be created before use.
		"auto.create.topics.enable": "false",
		// Tests start groups all the time: no 3 s wait for more members.
		"group.initial.rebalance.delay.ms": "0",
		// Tests use session timeouts down to 500 ms (the broker's default
		// minimum is 6 s; a consumer asking for less is refused with
		// INVALID_SESSION_TIMEOUT).
		"group.min.session.timeout.ms": "500",
		// A broker restarted after SIGKILL registers again only once the
		// controller expired its previous registration's session (9 s by
		// default; the restart waited that long): 4 s, heartbeats every
		// second.
		"broker.session.timeout.ms":    "4000",
		"broker.heartbeat.interval.ms": "1000",
		// Small, quickly rolled segments and indexes: little disk and
		// memory per partition.
		"log.segment.bytes":               strconv.Itoa(8 << 20),
		"log.index.size.max.bytes":        strconv.Itoa(1 << 20),
		"log.retention.check.interval.ms": "60000",
		// A light load: few threads.
		"num.network.threads":               "2",
		"num.io.threads":                    "4",
		"background.threads":                "4",
		"num.recovery.threads.per.data.dir": "1",
		"log.cleaner.threads":               "1",
		"log.cleaner.dedupe.buffer.size":    strconv.Itoa(4 << 20),
		"num.replica.fetchers":              "1",
		"delete.topic.enable":               "true",
	}
	keys := make([]string, 0, len(p))
	for k := range p {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var s strings.Builder
	s.WriteString("# Written by eventline's internal/kafkabroker.\n")
	for _, k := range keys {
		fmt.Fprintf(&s, "%s=%s\n", k, p[k])
	}
	return s.String()
}

// log4j is the broker's log4j2 configuration: server.log in its directory.
func (b *Broker) log4j() string {
	return strings.Join([]string{
		"status = error",
		"appender.file.type = File",
		"appender.file.name = file",
		"appender.file.fileName = " + filepath.Join(b.dir, "server.log"),
		"appender.file.layout.type = PatternLayout",
		"appender.file.layout.pattern = [%d] %p %m (%c)%n",
		"rootLogger.level = " + b.cfg.LogLevel,
		"rootLogger.appenderRef.file.ref = file",
		// The start and stop lines, whatever the level.
		"logger.server.name = kafka.server.KafkaRaftServer",
		"logger.server.level = INFO",
		"",
	}, "\n")
}

// JavaTool returns the path of a JDK tool (java, javac):
// $JAVA_HOME/bin/name, else name on PATH.
func JavaTool(name string) (string, error) {
	if home := os.Getenv("JAVA_HOME"); home != "" {
		if p := filepath.Join(home, "bin", name); fileExists(p) {
			return p, nil
		}
	}
	return exec.LookPath(name)
}

// javaPath finds java (JavaTool).
func javaPath() (string, error) {
	p, err := JavaTool("java")
	if err != nil {
		return "", ErrNoJava
	}
	return p, nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// ErrNoJava says Java is missing.
var ErrNoJava = errors.New("kafkabroker: java is not installed (Apache Kafka 4 needs Java 17 or newer: apt-get install openjdk-17-jre-headless, or set JAVA_HOME)")

// Available reports whether a broker can be started here: Java installed,
// and the jars cached or Maven installed to resolve them.
func Available() error {
	if _, err := javaPath(); err != nil {
		return err
	}
	if _, err := exec.LookPath("mvn"); err != nil && !Resolved() {
		return errNoMaven
	}
	return nil
}

// freePort returns a port of 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("kafkabroker: find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// randomClusterID returns a Kafka cluster id: 16 random bytes in URL-safe
// base64 without padding, not starting with '-' (Kafka's Uuid.randomUuid).
func randomClusterID() string {
	for {
		var b [16]byte
		_, _ = crand.Read(b[:])
		id := base64.RawURLEncoding.EncodeToString(b[:])
		if id[0] != '-' {
			return id
		}
	}
}
