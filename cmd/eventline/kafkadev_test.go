package main

import (
	"context"
	"net"
	"regexp"
	"strconv"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/kafkaconf"
)

func TestKafkaDev(t *testing.T) {
	t.Parallel()

	t.Run("serves metadata until cancelled", func(t *testing.T) {
		t.Parallel()
		dev := start(t, "kafka-dev", "-port", "0", "-partitions", "3", "-topics", "orders,billing")
		out := waitOutput(t, dev, dev.stdout, "\n")
		m := regexp.MustCompile(`^KAFKA_BROKERS=(127\.0\.0\.1:(\d+))\n$`).FindStringSubmatch(out)
		require.NotNil(t, m, "the first line is KAFKA_BROKERS=host:port, got %q", out)
		port, err := strconv.Atoi(m[2])
		require.NoError(t, err)
		require.NotZero(t, port, "-port 0 picked a free port")

		cfg := sarama.NewConfig()
		cfg.Version = kafkaconf.Version
		client, err := sarama.NewClient([]string{m[1]}, cfg)
		require.NoError(t, err)
		defer client.Close()
		require.NoError(t, client.RefreshMetadata())
		require.Len(t, client.Brokers(), 1)
		topics, err := client.Topics()
		require.NoError(t, err)
		require.Subset(t, topics, []string{"orders", "billing"}, "-topics are created at start")
		parts, err := client.Partitions("orders")
		require.NoError(t, err)
		require.Len(t, parts, 3, "-partitions")
		require.NoError(t, client.Close())

		require.Equal(t, exitOK, dev.stop(t))
		require.Contains(t, dev.stderr.String(), "in-process Kafka stopped")
		_, err = net.Dial("tcp", m[1])
		require.Error(t, err, "the broker is gone after stop")
	})

	t.Run("port in use", func(t *testing.T) {
		t.Parallel()
		var lc net.ListenConfig
		ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
		require.NoError(t, err)
		defer ln.Close()
		port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)

		r := cli(t, "kafka-dev", "-port", port)
		require.Equal(t, exitFailure, r.code)
		require.Contains(t, r.stderr, "is port "+port+" in use? pick another with -port")
		require.Empty(t, r.stdout, "no KAFKA_BROKERS line when it did not start")
	})
}
