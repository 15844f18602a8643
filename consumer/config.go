package consumer

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/IBM/sarama"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/middleware"
)

// Defaults and bounds of the runner's own fields of [Config].
const (
	// DefaultLanes is how many lanes each partition is split into.
	DefaultLanes = 8
	// DefaultBatchSize is the most events of one lane applied in one
	// transaction.
	DefaultBatchSize = 16
	// DefaultBatchLinger is how long a lane waits for a batch to fill: 0,
	// a batch takes what is already waiting when the lane is free.
	DefaultBatchLinger = time.Duration(0)
	// DefaultShutdownTimeout bounds how long Run waits for in-flight
	// events when its context ends.
	DefaultShutdownTimeout = 30 * time.Second
	// MaxLanes bounds Lanes.
	MaxLanes = 256
	// MaxBatchSize bounds BatchSize.
	MaxBatchSize = 1000
	// MaxBatchLinger bounds BatchLinger.
	MaxBatchLinger = time.Second
)

// Config configures a Consumer. Only Group and Topics are required.
//
// It embeds the middleware's Config, which holds every setting the
// consumer shares with the middleware on your own Router (the group, the
// schema, the gate's policies, retries, waits for the database, the
// transaction's bound, upcasting, your own middleware, logging, metrics,
// tracing; see middleware.Config), and adds the runner's own: where to
// read (Brokers, Topics, SaramaConfig) and how (Lanes, BatchSize,
// BatchLinger, ShutdownTimeout).
//
//	cfg := consumer.Config{Topics: []string{"orders"}, Lanes: 4}
//	cfg.Group, cfg.MaxRetries = "billing", 3
//
// In the consumer, Group is also the Kafka consumer group. Its errors name
// the field as consumer.Config.<Field>, the embedded ones too.
type Config struct {
	middleware.Config
	// Brokers are the Kafka brokers, host:port. Defaults to the
	// comma-separated list in the KAFKA_BROKERS environment variable.
	Brokers []string
	// Topics are the Kafka topics to consume; each gets one Watermill
	// handler named "eventline/<group>/<topic>". Required.
	Topics []string
	// SaramaConfig is the Kafka consumer's Sarama configuration. Defaults
	// to a configuration that starts a new group at the oldest offset
	// (Consumer.Offsets.Initial = sarama.OffsetOldest) and auto-commits
	// marked offsets every second. When you pass your own, keep
	// OffsetOldest, or a new group skips events published before it
	// started. New checks it with Sarama's Validate.
	SaramaConfig *sarama.Config
	// Lanes is how many lanes each Kafka partition is split into, by
	// aggregate, to run concurrently (see the package documentation,
	// "Lanes and batches", and how to size the pool for them). 1 handles a
	// partition's events one at a time. Defaults to DefaultLanes (8); at
	// most MaxLanes.
	Lanes int
	// BatchSize is the most events of one lane applied in one PostgreSQL
	// transaction (see the package documentation, "Lanes and batches"):
	// per-event guarantees are unchanged. It also bounds how many single
	// events of different lanes of a topic share one transaction when
	// every delivery slot is busy (see Lanes). 1 applies each event in its
	// own transaction (and coalesces nothing). Defaults to
	// DefaultBatchSize (16); at most MaxBatchSize.
	BatchSize int
	// BatchLinger is how long a free lane waits for more events before it
	// applies a batch that is not full. Defaults to DefaultBatchLinger (0:
	// a batch is what queued up while the lane was busy, so an idle
	// consumer applies each event at once). At most MaxBatchLinger.
	BatchLinger time.Duration
	// ShutdownTimeout bounds how long Run waits, after its context ends,
	// for in-flight events to finish; events still running then are rolled
	// back (and redelivered later). Defaults to DefaultShutdownTimeout
	// (30s).
	ShutdownTimeout time.Duration
}

// runnerDefaults fills the runner's own fields; the middleware fills the
// embedded ones (the runner logs through the same default logger, and
// waits for Kafka at startup on the database-wait schedule).
func (c Config) runnerDefaults() Config {
	c.Logger = cmp.Or(c.Logger, slog.Default())
	c.InfraBackoff = c.InfraBackoff.Or(middleware.DefaultInfraBackoff)
	if len(c.Brokers) == 0 {
		c.Brokers = kafkaconf.BrokersFromEnv()
	}
	if c.SaramaConfig == nil {
		c.SaramaConfig = kafkaconf.Consumer("eventline-" + c.Group)
	}
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, DefaultShutdownTimeout)
	c.Lanes = cmp.Or(c.Lanes, DefaultLanes)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	return c
}

// validateRunner checks the runner's own fields (the middleware checks the
// embedded ones).
func (c Config) validateRunner() error {
	if err := kafkaconf.ValidateBrokers("consumer.Config.Brokers", c.Brokers); err != nil {
		return err
	}
	if len(c.Topics) == 0 {
		return errors.New("consumer.Config.Topics is empty: name at least one topic to consume")
	}
	seen := map[string]bool{}
	for _, t := range c.Topics {
		if err := eventline.ValidateTopic(t); err != nil {
			return fmt.Errorf("consumer.Config.Topics: %w", err)
		}
		if seen[t] {
			return fmt.Errorf("consumer.Config.Topics lists %q twice", t)
		}
		seen[t] = true
	}
	switch {
	case c.Lanes < 0 || c.Lanes > MaxLanes:
		return fmt.Errorf("consumer.Config.Lanes is %d; use 1 to %d (0 means %d)", c.Lanes, MaxLanes, DefaultLanes)
	case c.BatchSize < 0 || c.BatchSize > MaxBatchSize:
		return fmt.Errorf("consumer.Config.BatchSize is %d; use 1 (no batching) to %d (0 means %d)", c.BatchSize, MaxBatchSize, DefaultBatchSize)
	case c.BatchLinger < 0 || c.BatchLinger > MaxBatchLinger:
		return fmt.Errorf("consumer.Config.BatchLinger is %s; use 0 to %s: a longer wait holds every batch back", c.BatchLinger, MaxBatchLinger)
	case c.ShutdownTimeout < 0:
		return fmt.Errorf("consumer.Config.ShutdownTimeout is %s; it must be positive", c.ShutdownTimeout)
	}
	if err := c.SaramaConfig.Validate(); err != nil {
		// Run's Kafka subscriber would refuse it.
		return fmt.Errorf("consumer.Config.SaramaConfig: %w", err)
	}
	return nil
}
