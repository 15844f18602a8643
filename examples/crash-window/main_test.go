package main

import (
	"bytes"
	"context"
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
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	err := run(ctx, cfg, &out)
	t.Logf("output:\n%s", out.String())
	require.NoError(t, err)

	lines := extest.Parse(t, out.String())
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
		e, err := eventline.NewJSONEvent("order.created", "order", fmt.Sprint(i), OrderCreated{OrderID: i, OrderNo: fmt.Sprint(i), AmountCents: 500})
		require.NoError(t, err)
		events = append(events, e)
	}
	handler := ship("shipments")
	eventlinetest.Run(t, eventlinetest.Case{
		DatabaseURL: setup.DatabaseURL(),
		Setup:       eventlinetest.SQL(ddl...),
		Handler: func(msg *message.Message) ([]*message.Message, error) {
			return nil, handler(msg)
		},
		Events: events,
		State:  eventlinetest.Rows(`SELECT order_id, event_id FROM shipments ORDER BY order_id, event_id`),
	})
}
