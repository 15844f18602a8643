package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/eventlinetest"
	"github.com/eventline/eventline/examples/internal/extest"
)

func TestMain(m *testing.M) { extest.VerifyTestMain(m) }

func TestCrashWindow(t *testing.T) {
	cfg := extest.Common(t, "example_crash_window")
	lines := extest.Parse(t, extest.Run(t, 3*time.Minute, run, cfg))
	require.NotEmpty(t, extest.Find(t, lines, "message_id")["message_id"])
	extest.Expect(t, lines, "published=1 outbox_acked=0 simulated_crash=true")
	extest.Expect(t, lines, "published_after_crash=1 outbox_pending=1")
	extest.Expect(t, lines, "published_after_retry=2 outbox_pending=0")
	extest.Expect(t, lines, "delivered=2 applied=1 duplicates_skipped=1")
	extest.NoConnections(t, cfg.Schema)
}

// TestHandlerUnderFaults checks the Watermill handler with eventline's
// test kit, behind the same middleware the example's router uses: every
// order gets one shipment whatever the deliveries.
func TestHandlerUnderFaults(t *testing.T) {
	var events []eventline.Event
	for i := int64(1); i <= 5; i++ {
		events = append(events, extest.Event(t, "order.created", "order", fmt.Sprint(i), OrderCreated{OrderID: i, OrderNo: fmt.Sprint(i), AmountCents: 500}))
	}
	handler := ship("shipments")
	extest.UnderFaults(t, ddl, eventlinetest.Case{
		Handler: func(msg *message.Message) ([]*message.Message, error) {
			return nil, handler(msg)
		},
		Events: events,
		State:  eventlinetest.Rows(`SELECT order_id, event_id FROM shipments ORDER BY order_id, event_id`),
	})
}
