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
	"github.com/eventline/eventline/examples/internal/setup"
)

func TestMain(m *testing.M) { extest.VerifyTestMain(m) }

func TestCrashWindow(t *testing.T) {
	cfg := config{
		Common: extest.Common(t, "example_crash_window"),
	}
	lines := extest.Parse(t, extest.Run(t, 3*time.Minute, run, cfg))
	require.NotEmpty(t, extest.Find(t, lines, "message_id")["message_id"])
	first := extest.Find(t, lines, "simulated_crash")
	require.Equal(t, "true", first["simulated_crash"])
	require.Equal(t, 1, extest.Int(t, first, "published"))
	require.Equal(t, 0, extest.Int(t, first, "outbox_acked"))
	crash := extest.Find(t, lines, "published_after_crash")
	require.Equal(t, 1, extest.Int(t, crash, "published_after_crash"))
	require.Equal(t, 1, extest.Int(t, crash, "outbox_pending"))
	retry := extest.Find(t, lines, "published_after_retry")
	require.Equal(t, 2, extest.Int(t, retry, "published_after_retry"))
	require.Equal(t, 0, extest.Int(t, retry, "outbox_pending"))
	consumed := extest.Find(t, lines, "applied")
	require.Equal(t, 2, extest.Int(t, consumed, "delivered"))
	require.Equal(t, 1, extest.Int(t, consumed, "applied"))
	require.Equal(t, 1, extest.Int(t, consumed, "duplicates_skipped"))
	extest.NoConnections(t, setup.AppName(cfg.Schema))
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
