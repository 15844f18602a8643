package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/cmd/eventline/internal/devkafka"
	"github.com/eventline/eventline/internal/kafkaconf"
)

// defaultKafkaDevPort is Kafka's usual port.
const defaultKafkaDevPort = 9092

const kafkaDevHelp = `
Runs a one-broker, in-memory Kafka (franz-go's kfake) on 127.0.0.1 until
interrupted. Its first line of output is the setting other processes need,
e.g. KAFKA_BROKERS=127.0.0.1:9092: export it in their shell.

Topics are created with -partitions partitions on first use by a client that
asks for auto-creation; the relay does not ask, so create the topics it
publishes to up front with -topics. Everything is lost when it stops. For
development and tests only.`

func runKafkaDev(ctx context.Context, inv *invocation) error {
	fs := inv.fs
	port := fs.Int("port", defaultKafkaDevPort, "TCP port on 127.0.0.1; 0 picks a free port")
	partitions := fs.Int("partitions", devkafka.DefaultPartitions, "partitions of every topic it creates")
	topics := fs.String("topics", "", "comma-separated topics to create at start")
	if _, err := inv.parse(); err != nil {
		return err
	}
	if *port < 0 || *port > 65535 {
		return usageErrorf("-port must be between 0 and 65535, got %d", *port)
	}
	if *partitions < 1 || *partitions > 10000 {
		return usageErrorf("-partitions must be between 1 and 10000, got %d", *partitions)
	}
	seed := kafkaconf.ParseBrokers(*topics) // same comma-separated shape
	for _, t := range seed {
		if err := eventline.ValidateTopic(t); err != nil {
			return usageErrorf("-topics: %v", err)
		}
	}
	opts := []kfake.Opt{kfake.DefaultNumPartitions(*partitions)}
	if len(seed) > 0 {
		opts = append(opts, kfake.SeedTopics(int32(*partitions), seed...))
	}
	cluster, err := devkafka.Start(*port, opts...)
	if err != nil {
		if *port != 0 {
			return fmt.Errorf("%w (is port %d in use? pick another with -port, or -port 0 for a free one)", err, *port)
		}
		return err
	}
	defer cluster.Close()
	addrs := cluster.ListenAddrs()
	fmt.Fprintf(inv.stdout, "%s=%s\n", envBrokers, strings.Join(addrs, ","))
	inv.logger().Info("in-process Kafka running; interrupt to stop", "brokers", addrs, "partitions", *partitions, "topics", seed)
	<-ctx.Done()
	inv.logger().Info("in-process Kafka stopped")
	return nil
}
