package producer

import (
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
)

// partitionOf returns the partition the relay's Kafka producer picks for
// key among n partitions, with cfg's partitioner.
func partitionOf(t *testing.T, cfg RelayConfig, key string, n int32) int32 {
	t.Helper()
	p := cfg.withDefaults().producerConfig().Producer.Partitioner("topic")
	got, err := p.Partition(&sarama.ProducerMessage{Topic: "topic", Key: sarama.StringEncoder(key)}, n)
	require.NoError(t, err)
	return got
}

// TestDefaultPartitionerMatchesKafkasJavaClient: by default the relay puts
// each key in the partition Kafka's Java client (DefaultPartitioner,
// Kafka Streams), franz-go and librdkafka's murmur2 partitioner choose:
// toPositive(murmur2(key)) % partitions.
func TestDefaultPartitionerMatchesKafkasJavaClient(t *testing.T) {
	cfg := RelayConfig{Brokers: []string{"localhost:9092"}}

	// Golden murmur2 values from Apache Kafka's UtilsTest.testMurmur2.
	for key, hash := range map[string]int32{
		"21":                         -973932308,
		"foobar":                     -790332482,
		"a-little-bit-long-string":   -985981536,
		"a-little-bit-longer-string": -1486304829,
		"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
		"abc": 479470107,
	} {
		for _, n := range []int32{1, 3, 7, 12, 100, 1000} {
			want := (hash & 0x7fffffff) % n
			require.Equal(t, want, partitionOf(t, cfg, key, n), "key %q, %d partitions", key, n)
		}
	}
	// Partitions the Java client's DefaultPartitioner picks among 100
	// (published with Sarama's murmur2 partitioner).
	for key, want := range map[string]int32{"foo": 16, "bar": 45, "baz": 80, "kafka": 80, "sarama": 11} {
		require.Equal(t, want, partitionOf(t, cfg, key, 100), "key %q", key)
	}
	// And franz-go's default for keyed records agrees on any key.
	franz := kgo.StickyKeyPartitioner(nil).ForTopic("topic")
	for i := 0; i < 2000; i++ {
		key := "order-" + strconv.FormatUint(rand.Uint64(), 36)
		n := int32(1 + rand.IntN(64))
		want := franz.Partition(&kgo.Record{Key: []byte(key)}, int(n))
		require.EqualValues(t, want, partitionOf(t, cfg, key, n), "key %q, %d partitions", key, n)
	}
}

// TestFNV1aPartitionerKeepsTheOldMapping: deployments that relayed with
// Sarama's hash partitioner keep their key → partition mapping with
// PartitionerFNV1a.
func TestFNV1aPartitionerKeepsTheOldMapping(t *testing.T) {
	cfg := RelayConfig{Brokers: []string{"localhost:9092"}, Partitioner: PartitionerFNV1a}
	old := sarama.NewHashPartitioner("topic")
	for i := 0; i < 500; i++ {
		key := "agg-" + strconv.Itoa(i)
		want, err := old.Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder(key)}, 12)
		require.NoError(t, err)
		require.Equal(t, want, partitionOf(t, cfg, key, 12))
	}
}

func TestPartitionerIsValidated(t *testing.T) {
	err := RelayConfig{Brokers: []string{"localhost:9092"}, Partitioner: "crc32"}.withDefaults().validate()
	require.ErrorContains(t, err, "RelayConfig.Partitioner")
	err = RelayConfig{Brokers: []string{"localhost:9092"}, Partitioner: PartitionerSaramaConfig}.withDefaults().validate()
	require.ErrorContains(t, err, "RelayConfig.SaramaConfig")

	sc := sarama.NewConfig()
	sc.Producer.Partitioner = sarama.NewRoundRobinPartitioner
	cfg := RelayConfig{Brokers: []string{"localhost:9092"}, Partitioner: PartitionerSaramaConfig, SaramaConfig: sc}.withDefaults()
	require.NoError(t, cfg.validate())
	p := cfg.producerConfig().Producer.Partitioner("t")
	for want := int32(0); want < 3; want++ {
		got, err := p.Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder("same")}, 3)
		require.NoError(t, err)
		require.Equal(t, want, got, "the configured round-robin partitioner is used")
	}

	// A SaramaConfig with Sarama's default partitioner still gets murmur2.
	cfg = RelayConfig{Brokers: []string{"localhost:9092"}, SaramaConfig: sarama.NewConfig()}.withDefaults()
	require.EqualValues(t, 16, partitionOf(t, cfg, "foo", 100))
}
