package consumer

import (
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
)

// subscriber returns the Kafka subscriber Run reads from: the laned,
// batching Subscriber, or watermill-kafka's subscriber (one event per
// partition at a time) when Config.Lanes and Config.BatchSize are both 1.
func (c *Consumer) subscriber(wlog watermill.LoggerAdapter) (message.Subscriber, error) {
	cfg := c.cfg
	if cfg.Lanes == 1 && cfg.BatchSize == 1 {
		sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
			Brokers:               cfg.Brokers,
			Unmarshaler:           kafka.DefaultMarshaler{},
			OverwriteSaramaConfig: cfg.SaramaConfig,
			ConsumerGroup:         cfg.Group,
		}, wlog)
		if err != nil {
			return nil, fmt.Errorf("eventline consumer: create the Kafka subscriber for brokers %s: %w", strings.Join(cfg.Brokers, ","), err)
		}
		return sub, nil
	}
	sub, err := NewSubscriber(SubscriberConfig{
		Brokers:      cfg.Brokers,
		Group:        cfg.Group,
		SaramaConfig: cfg.SaramaConfig,
		Lanes:        cfg.Lanes,
		BatchSize:    cfg.BatchSize,
		BatchLinger:  cfg.BatchLinger,
		CloseTimeout: cfg.ShutdownTimeout,
		Logger:       cfg.Logger,
		chainBatches: true, // Run's chain contains the eventline middleware
	})
	if err != nil {
		return nil, fmt.Errorf("eventline consumer: create the Kafka subscriber for brokers %s: %w", strings.Join(cfg.Brokers, ","), err)
	}
	return sub, nil
}
