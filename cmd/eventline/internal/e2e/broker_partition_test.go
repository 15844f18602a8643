package e2e_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/kafkabroker"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/producer"
)

// TestJavaClientAgreesOnPartitions: for 3000 keys (aggregate ids of many
// shapes and lengths, some not ASCII), Apache Kafka's Java producer with
// its default partitioner (testdata/PartitionProbe.java, against
// kafka-clients 4.4) and eventline's relay (its default
// partitioner) put each key's record in the same partition of a
// 12-partition topic, as the brokers report them. Another producer of the
// same aggregates, or Kafka Streams, thus agrees with eventline on where
// each aggregate lives.
func TestJavaClientAgreesOnPartitions(t *testing.T) {
	kafkatest.NeedReal(t)
	t.Parallel()
	ctx := context.Background()
	const partitions = 12
	k := kafkatest.Start(t, kafkatest.Config{})
	javaTopic, relayTopic := kafkatest.Topic(t, "java-partitions"), kafkatest.Topic(t, "relay-partitions")
	require.NoError(t, k.CreateTopics(ctx, partitions, javaTopic, relayTopic))

	prng := rand.New(rand.NewPCG(17, 42))
	keys := make([]string, 0, 3000)
	seen := map[string]bool{}
	for len(keys) < cap(keys) {
		var key string
		switch len(keys) % 5 {
		case 0:
			key = uuid.NewString()
		case 1:
			key = fmt.Sprintf("order-%d", prng.IntN(1_000_000))
		case 2:
			key = fmt.Sprint(prng.Int64())
		case 3:
			key = fmt.Sprintf("客户-%d-ü", prng.IntN(100_000))
		default:
			b := make([]byte, 1+prng.IntN(40))
			for i := range b {
				b[i] = byte('a' + prng.IntN(26))
			}
			key = string(b)
		}
		if !seen[key] {
			seen[key] = true
			keys = append(keys, key)
		}
	}

	begin := time.Now()
	java := runPartitionProbe(ctx, t, k.Brokers, javaTopic, keys)
	t.Logf("the Java producer wrote %d keys in %s (javac and JVM start included)", len(java), time.Since(begin).Round(time.Millisecond))
	recs, err := kafkatest.ReadTopic(ctx, k.Brokers, javaTopic)
	require.NoError(t, err)
	require.Len(t, recs, len(keys))
	for _, r := range recs {
		require.Equal(t, java[r.Key], r.Partition, "key %q: where the broker holds the Java producer's record", r.Key)
	}

	env := pgtest.New(t, pgtest.Options{Shards: 4, MaxConns: 12})
	prod, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: relayTopic})
	require.NoError(t, err)
	for i := 0; i < len(keys); i += 500 {
		var evs []eventline.Event
		for _, key := range keys[i:min(i+500, len(keys))] {
			e, err := eventline.NewJSONEvent("order.created", "order", key, map[string]string{"id": key})
			require.NoError(t, err)
			evs = append(evs, e)
		}
		require.NoError(t, prod.Publish(ctx, env.Pool, evs...))
	}
	rel, err := producer.NewRelay(ctx, env.Pool, producer.RelayConfig{Schema: env.Schema, Brokers: k.Brokers, PollInterval: 100 * time.Millisecond, Logger: testLogger()})
	require.NoError(t, err)
	stop := relaytest.Background(t, rel.Run)
	require.Eventually(t, func() bool {
		st, err := admin.ReadOutboxStatus(ctx, env.Pool, env.Schema)
		require.NoError(t, err)
		return st.Backlog() == 0
	}, 2*time.Minute, 50*time.Millisecond, "the relay publishes every event")
	stop()
	recs, err = kafkatest.ReadTopic(ctx, k.Brokers, relayTopic)
	require.NoError(t, err)
	relay := map[string]int32{}
	for _, r := range recs {
		relay[r.Key] = r.Partition
	}
	require.Len(t, relay, len(keys))
	counts := make([]int, partitions)
	for _, key := range keys {
		require.Equal(t, java[key], relay[key], "key %q: the Java producer's partition and eventline's relay's", key)
		counts[relay[key]]++
	}
	t.Logf("%d keys on the same partitions from both producers; per partition: %v", len(keys), counts)
}

// runPartitionProbe produces one record per key to topic with Kafka's Java
// producer (testdata/PartitionProbe.java, compiled against kafka-clients
// from the broker's own jars; default partitioner) and returns the
// partition the broker put each key's record in.
func runPartitionProbe(ctx context.Context, t *testing.T, brokers []string, topic string, keys []string) map[string]int32 {
	t.Helper()
	jars, err := kafkabroker.Jars(ctx)
	require.NoError(t, err)
	javac, err := kafkabroker.JavaTool("javac")
	require.NoError(t, err, "javac compiles the probe (apt-get install openjdk-17-jdk-headless)")
	java, err := kafkabroker.JavaTool("java")
	require.NoError(t, err)
	classes, classpath := t.TempDir(), filepath.Join(jars, "*")
	out, err := exec.CommandContext(ctx, javac, "-nowarn", "-cp", classpath, "-d", classes, filepath.Join("testdata", "PartitionProbe.java")).CombinedOutput()
	require.NoError(t, err, "javac PartitionProbe.java:\n%s", out)
	cmd := exec.CommandContext(ctx, java, "-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC",
		"-cp", classpath+string(os.PathListSeparator)+classes, "PartitionProbe", strings.Join(brokers, ","), topic)
	cmd.Stdin = strings.NewReader(strings.Join(keys, "\n") + "\n")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.Output()
	require.NoError(t, err, "java PartitionProbe:\n%s", stderr.String())
	placed := make(map[string]int32, len(keys))
	for _, line := range strings.Split(strings.TrimSpace(string(stdout)), "\n") {
		f := strings.Split(line, "\t")
		require.Len(t, f, 3, "PartitionProbe printed %q, want key, partition, offset", line)
		p, err := strconv.ParseInt(f[1], 10, 32)
		require.NoError(t, err, "PartitionProbe printed %q", line)
		placed[f[0]] = int32(p)
	}
	require.Len(t, placed, len(keys), "PartitionProbe reported every key")
	return placed
}
