package main

import (
	"testing"
	"time"

	"github.com/eventline/eventline/eventlinetest/kafkatest"
	"github.com/eventline/eventline/examples/internal/extest"
	"github.com/eventline/eventline/examples/internal/setup"
)

// TestMain fails the package if a goroutine is left running after the
// tests: the quickstart must shut down everything it started.
func TestMain(m *testing.M) { extest.VerifyTestMain(m) }

// TestQuickstart runs the README's first program end to end: 120 events
// over 12 orders, published, relayed and consumed, each applied once and
// in order, then a clean stop.
func TestQuickstart(t *testing.T) {
	topic := kafkatest.Topic("orders")
	k := kafkatest.Start(t, topic)
	cfg := config{
		DatabaseURL: setup.DatabaseURL(),
		Brokers:     k.Brokers,
		Schema:      extest.Schema("quickstart"),
		Topic:       topic,
		Orders:      12,
		Items:       9,
		Logger:      extest.Logger(t),
	}
	extest.DropSchemaAtEnd(t, cfg.Schema)
	extest.Expect(t, extest.Parse(t, extest.Run(t, 2*time.Minute, run, cfg)), "orders=12 published=120 applied=120 in_order=true")
}
