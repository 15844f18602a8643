package kafkabroker_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/kafkabroker"
)

// envChild makes the test binary a process that starts a broker, prints
// its JVM's pid and waits to be killed (TestTheBrokerDiesWithItsOwner).
const envChild = "EVENTLINE_KAFKABROKER_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(envChild) != "" {
		b, err := kafkabroker.Start(context.Background(), kafkabroker.Config{})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		fmt.Printf("jvm=%d dir=%s\n", b.Pid(), b.Dir())
		select {} // until killed
	}
	os.Exit(m.Run())
}

// needBroker skips a test unless the real-broker run is on (make
// test-kafka sets KAFKA_BROKERS): these tests start JVMs of their own.
func needBroker(t *testing.T) {
	t.Helper()
	if os.Getenv("KAFKA_BROKERS") == "" {
		t.Skip("starts Apache Kafka (Java 17+, Maven): runs in make test-kafka, or with KAFKA_BROKERS set")
	}
	if err := kafkabroker.Available(); err != nil {
		t.Fatalf("KAFKA_BROKERS is set but no broker can be started here: %v", err)
	}
}

func start(t *testing.T, cfg kafkabroker.Config) *kafkabroker.Broker {
	t.Helper()
	b, err := kafkabroker.Start(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Stop()) })
	t.Logf("broker %s (pid %d) answered %s after its JVM started", b.Addr(), b.Pid(), b.StartupTime().Round(time.Millisecond))
	return b
}

func saramaConfig() *sarama.Config {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	cfg.Net.DialTimeout = time.Second
	cfg.Net.ReadTimeout = 2 * time.Second
	cfg.Metadata.Retry.Max = 0
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	return cfg
}

// answers reports whether the broker answers a metadata request.
func answers(addr string) bool {
	c, err := sarama.NewClient([]string{addr}, saramaConfig())
	if err != nil {
		return false
	}
	defer c.Close()
	return c.RefreshMetadata() == nil
}

func produce(t *testing.T, addr, topic string, n int) {
	t.Helper()
	p, err := sarama.NewSyncProducer([]string{addr}, saramaConfig())
	require.NoError(t, err)
	defer p.Close()
	for i := range n {
		_, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder(strconv.Itoa(i))})
		require.NoError(t, err)
	}
}

func newest(t *testing.T, addr, topic string) int64 {
	t.Helper()
	c, err := sarama.NewClient([]string{addr}, saramaConfig())
	require.NoError(t, err)
	defer c.Close()
	off, err := c.GetOffset(topic, 0, sarama.OffsetNewest)
	require.NoError(t, err)
	return off
}

// A broker answers, freezes on Pause and answers again on Resume, keeps
// its records across SIGKILL and Restart, and leaves neither JVM nor
// directory after Stop.
func TestBrokerLifecycle(t *testing.T) {
	needBroker(t)
	b := start(t, kafkabroker.Config{})
	require.True(t, answers(b.Addr()))
	admin, err := sarama.NewClusterAdmin([]string{b.Addr()}, saramaConfig())
	require.NoError(t, err)
	require.NoError(t, admin.CreateTopic("lifecycle", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false))
	require.NoError(t, admin.Close())
	require.Eventually(t, func() bool { return answers(b.Addr()) }, 30*time.Second, 100*time.Millisecond)
	produce(t, b.Addr(), "lifecycle", 10)

	require.NoError(t, b.Pause())
	require.False(t, answers(b.Addr()), "a paused broker does not answer")
	require.NoError(t, b.Resume())
	require.Eventually(t, func() bool { return answers(b.Addr()) }, 30*time.Second, 100*time.Millisecond)

	pid := b.Pid()
	require.NoError(t, b.Kill())
	require.False(t, b.Running())
	require.False(t, alive(pid))
	require.NoError(t, b.Restart(context.Background()))
	t.Logf("restarted after SIGKILL in %s", b.StartupTime().Round(time.Millisecond))
	require.EqualValues(t, 10, newest(t, b.Addr(), "lifecycle"), "acknowledged records survive a SIGKILL")
	produce(t, b.Addr(), "lifecycle", 1)

	require.NoError(t, b.Restart(context.Background()), "a running broker restarts cleanly")
	require.EqualValues(t, 11, newest(t, b.Addr(), "lifecycle"))

	pid, dir := b.Pid(), b.Dir()
	require.NoError(t, b.Stop())
	require.False(t, alive(pid), "no JVM left after Stop")
	_, err = os.Stat(dir)
	require.True(t, os.IsNotExist(err), "the data directory is removed")
	require.NoError(t, b.Stop(), "Stop twice is harmless")
}

// A broker may advertise another address than its listener's: clients
// then connect there (here, nothing listens: they cannot produce).
func TestBrokerAdvertisesTheGivenAddress(t *testing.T) {
	needBroker(t)
	b := start(t, kafkabroker.Config{Advertise: "127.0.0.1:1"})
	require.Equal(t, "127.0.0.1:1", b.Addr())
	c, err := sarama.NewClient([]string{b.ListenAddr()}, saramaConfig())
	require.NoError(t, err)
	defer c.Close()
	brokers := c.Brokers()
	require.Len(t, brokers, 1)
	require.Equal(t, "127.0.0.1:1", brokers[0].Addr(), "metadata advertises the given address")
}

// The JVM dies with the process that started it, even when that process is
// killed with SIGKILL and runs no cleanup; the next Start removes the
// directory it left.
func TestTheBrokerDiesWithItsOwner(t *testing.T) {
	needBroker(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"=1")
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err, "the child starts a broker")
	var jvm int
	var dir string
	_, err = fmt.Sscanf(strings.TrimSpace(line), "jvm=%d dir=%s", &jvm, &dir)
	require.NoError(t, err, "child said %q", line)
	require.True(t, alive(jvm))

	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait()
	require.Eventually(t, func() bool { return !alive(jvm) }, 10*time.Second, 50*time.Millisecond, "the JVM outlived its owner")

	start(t, kafkabroker.Config{}) // sweeps directories of dead owners
	_, err = os.Stat(dir)
	require.True(t, os.IsNotExist(err), "the dead owner's directory %s is removed", dir)
}

func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	// A zombie (exited, not yet reaped) counts as dead.
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	f := strings.Fields(string(st))
	return len(f) > 2 && f[2] != "Z"
}
