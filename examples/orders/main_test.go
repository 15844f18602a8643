package main

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/eventlinetest"
	"github.com/eventline/eventline/examples/internal/extest"
	"github.com/eventline/eventline/examples/internal/setup"
)

func TestMain(m *testing.M) { extest.VerifyTestMain(m) }

func TestOrders(t *testing.T) {
	cfg := config{
		Common:         extest.Common(t, "example_orders"),
		Orders:         120,
		RedeliverEvery: 4,
		Writers:        3,
		Progress:       500 * time.Millisecond,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	err := run(ctx, cfg, &out)
	t.Logf("output:\n%s", out.String())
	require.NoError(t, err)

	lines := extest.Parse(t, out.String())
	require.Equal(t, "progress", lines[1].Tag)
	sum := extest.Find(t, lines, "orders", "forwarded", "billing_applied", "shipping_applied", "duplicates_skipped")
	require.Equal(t, 120, extest.Int(t, sum, "orders"))
	require.Equal(t, 120, extest.Int(t, sum, "forwarded"))
	require.Equal(t, 120, extest.Int(t, sum, "billing_applied"))
	require.Equal(t, 120, extest.Int(t, sum, "shipping_applied"))
	require.Equal(t, 30, extest.Int(t, sum, "republished"))
	require.Equal(t, 60, extest.Int(t, sum, "redelivered"))
	require.Equal(t, 60, extest.Int(t, sum, "duplicates_skipped"), "each republished record is skipped once per group")
	extest.NoConnections(t, setup.AppName(cfg.Schema))
}

// TestHandlersUnderFaults checks billing's and shipping's handlers with
// eventline's test kit: whatever the deliveries (duplicated, reordered,
// after crashes and rebalances, failing on first attempt), each group's
// table ends up with one row per order, as when each event is applied
// once.
func TestHandlersUnderFaults(t *testing.T) {
	var events []eventline.Event
	for i := int64(1); i <= 6; i++ {
		e, err := eventline.NewJSONEvent("order.created", "order", fmt.Sprint(i), OrderCreated{OrderID: i, OrderNo: fmt.Sprintf("A-%06d", i), AmountCents: 1000 + i})
		require.NoError(t, err)
		events = append(events, e)
	}
	for _, g := range groups {
		t.Run(g.name, func(t *testing.T) {
			eventlinetest.Run(t, eventlinetest.Case{
				DatabaseURL: setup.DatabaseURL(),
				Setup:       eventlinetest.SQL(ddl...),
				Handlers:    map[string]consumer.HandlerFunc{"order.created": eventlinetest.JSON(g.handler(g.table))},
				Events:      events,
				State:       eventlinetest.Rows(`SELECT order_id, event_id FROM ` + g.table + ` ORDER BY order_id, event_id`),
			})
		})
	}
}
