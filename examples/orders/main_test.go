package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/eventlinetest"
	"github.com/eventline/eventline/examples/internal/extest"
)

func TestMain(m *testing.M) { extest.VerifyTestMain(m) }

// demo is the demo's configuration for a test: orders created by writers
// concurrent transactions, every fourth order's event delivered twice.
func demo(t *testing.T, orders, writers int) config {
	return config{Common: extest.Common(t, "example_orders"), Orders: orders, RedeliverEvery: 4, Writers: writers}
}

func TestOrders(t *testing.T) {
	cfg := demo(t, 120, 3)
	cfg.Progress = 500 * time.Millisecond
	lines := extest.Parse(t, extest.Run(t, 3*time.Minute, run, cfg))
	require.Equal(t, "progress", lines[1].Tag)
	extest.Expect(t, lines, "orders=120 forwarded=120 billing_applied=120 shipping_applied=120 republished=30 redelivered=60")
	extest.Expect(t, lines, "orders=120 duplicates_skipped=60", "each republished record is skipped once per group")
	extest.NoConnections(t, cfg.Schema)
}

// TestHandlersUnderFaults checks billing's and shipping's handlers with
// eventline's test kit: whatever the deliveries (duplicated, reordered,
// after crashes and rebalances, failing on first attempt), each group's
// table ends up with one row per order, as when each event is applied
// once.
func TestHandlersUnderFaults(t *testing.T) {
	var events []eventline.Event
	for i := int64(1); i <= 6; i++ {
		events = append(events, extest.Event(t, "order.created", "order", fmt.Sprint(i), OrderCreated{OrderID: i, OrderNo: fmt.Sprintf("A-%06d", i), AmountCents: 1000 + i}))
	}
	for _, g := range groups {
		t.Run(g.name, func(t *testing.T) {
			extest.UnderFaults(t, ddl, eventlinetest.Case{
				Handlers: map[string]consumer.HandlerFunc{"order.created": eventlinetest.JSON(g.handler(g.table))},
				Events:   events,
				State:    eventlinetest.Rows(`SELECT order_id, event_id FROM ` + g.table + ` ORDER BY order_id, event_id`),
			})
		})
	}
}

// TestOrdersTrace runs the demo with -trace: one order's spans, printed
// at the end, make one trace from the transaction that created it to each
// group's handler, through the relay's send span, with the redelivered
// copy seen as a duplicate.
func TestOrdersTrace(t *testing.T) {
	cfg := demo(t, 8, 2)
	cfg.Trace = true
	summary, tree, ok := strings.Cut(extest.Run(t, 3*time.Minute, run, cfg), "trace order=")
	require.True(t, ok, "a trace is printed")
	extest.Find(t, extest.Parse(t, summary), "orders", "duplicates_skipped")
	lines := strings.Split(strings.TrimSpace(tree), "\n")
	require.True(t, strings.HasPrefix(lines[0], "A-000004 "), "the trace of order 4, the first delivered twice: %q", lines[0])
	count := func(substrings ...string) int {
		n := 0
		for _, l := range lines {
			all := true
			for _, s := range substrings {
				all = all && strings.Contains(l, s)
			}
			if all {
				n++
			}
		}
		return n
	}
	indent := func(prefix string) int {
		for _, l := range lines {
			if strings.HasPrefix(strings.TrimLeft(l, " "), prefix) {
				return len(l) - len(strings.TrimLeft(l, " "))
			}
		}
		t.Fatalf("no span %q in\n%s", prefix, tree)
		return 0
	}
	require.Equal(t, 1, count("create order A-000004 [internal]"))
	require.Equal(t, 1, count("send ", "[producer]", "messaging.destination.partition.id="))
	require.Equal(t, 2, count("process ", "[consumer]", "eventline.outcome=applied"), "billing and shipping applied it")
	require.Equal(t, 2, count("process ", "[consumer]", "eventline.outcome=duplicate"), "and each skipped the copy")
	require.Equal(t, 1, count("insert invoice"))
	require.Equal(t, 1, count("insert shipment"))
	require.Less(t, indent("create order"), indent("send "))
	for j, l := range lines {
		if strings.Contains(l, "insert ") {
			// The tree prints children right after their parent.
			require.Contains(t, lines[j-1], "eventline.outcome=applied", "the handler's span is under the applying process span")
			require.Equal(t, indent(strings.TrimSpace(lines[j-1]))+2, indent(strings.TrimSpace(l)))
		}
	}
	extest.NoConnections(t, cfg.Schema)
}
