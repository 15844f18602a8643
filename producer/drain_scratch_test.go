package producer_test

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/producer"
)

func TestScratchDrain(t *testing.T) {
	if os.Getenv("SCRATCH") == "" {
		t.Skip()
	}
	shards, _ := strconv.Atoi(os.Getenv("SHARDS"))
	n, _ := strconv.Atoi(os.Getenv("N"))
	env := pgtest.New(t, pgtest.Options{Shards: shards, MaxConns: int32(shards + 4)})
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, "drain")
	kafkatest.CreateTopic(t, brokers, topic, 12)
	start := time.Now()
	publishOrders(t, env, topic, 1000, n, 100)
	t.Logf("prefill %d in %s", n, time.Since(start))
	start = time.Now()
	_, stop := startRelay(t, env, producer.RelayConfig{Brokers: brokers})
	for {
		st, err := producer.ReadStatus(context.Background(), env.Pool, env.Schema)
		require.NoError(t, err)
		if st.Backlog() == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	el := time.Since(start)
	t.Logf("drained %d with %d shards in %s: %.0f/s", n, shards, el, float64(n)/el.Seconds())
	stop()
}
