// Package devkafka runs franz-go's kfake, an in-process Kafka-protocol
// cluster, for the demo, the examples, `eventline kafka-dev` and tests.
// Clients reach it over TCP like any broker.
package devkafka

import (
	"fmt"

	"github.com/twmb/franz-go/pkg/kfake"
)

// DefaultPartitions is the partition count of topics the dev cluster creates
// on first use.
const DefaultPartitions = 12

// Start starts a one-broker kfake cluster. port 0 picks a free port. Topics
// are created on first use with DefaultPartitions partitions. Extra options
// are passed to kfake.
func Start(port int, opts ...kfake.Opt) (*kfake.Cluster, error) {
	base := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.AllowAutoTopicCreation(),
		kfake.DefaultNumPartitions(DefaultPartitions),
	}
	if port != 0 {
		base = append(base, kfake.Ports(port))
	}
	c, err := kfake.NewCluster(append(base, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("start in-process Kafka (kfake): %w", err)
	}
	return c, nil
}
