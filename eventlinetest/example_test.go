package eventlinetest_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/eventlinetest"
)

// OrderCreated and OrderCancelled are the payloads of the README's order
// events.
type OrderCreated struct {
	ID          string `json:"id"`
	AmountCents int64  `json:"amount_cents"`
}

type OrderCancelled struct {
	ID string `json:"id"`
}

// invoice and cancelInvoice are billing's handlers, as registered with
// consumer.HandleJSON.
func invoice(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderCreated) error {
	_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id, amount_cents) VALUES ($1, $2)`, o.ID, o.AmountCents)
	return err
}

func cancelInvoice(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderCancelled) error {
	_, err := tx.Exec(ctx, `UPDATE invoices SET cancelled = true WHERE order_id = $1`, o.ID)
	return err
}

func orderEvent(typ, id string, payload any) eventline.Event {
	e, err := eventline.NewJSONEvent(typ, "order", id, payload)
	if err != nil {
		panic(err)
	}
	return e
}

// TestInvoicing is the README's test kit snippet.
func TestInvoicing(t *testing.T) {
	eventlinetest.Run(t, eventlinetest.Case{
		Setup: eventlinetest.SQL(`CREATE TABLE invoices (
			order_id text PRIMARY KEY, amount_cents bigint NOT NULL, cancelled bool NOT NULL DEFAULT false)`),
		Handlers: map[string]consumer.HandlerFunc{
			"order.created":   eventlinetest.JSON(invoice), // the functions given to consumer.HandleJSON
			"order.cancelled": eventlinetest.JSON(cancelInvoice),
		},
		Events: []eventline.Event{ // in publish order; versions 1, 2… per order are filled in
			orderEvent("order.created", "o-1", OrderCreated{ID: "o-1", AmountCents: 1250}),
			orderEvent("order.created", "o-2", OrderCreated{ID: "o-2", AmountCents: 990}),
			orderEvent("order.cancelled", "o-1", OrderCancelled{ID: "o-1"}),
		},
		State: eventlinetest.Rows(`SELECT order_id, amount_cents, cancelled FROM invoices ORDER BY order_id`),
	})
}

// Check runs a Case without a test and returns what Run would report.
func ExampleCheck() {
	f, err := eventlinetest.Check(context.Background(), eventlinetest.Case{
		Setup:    eventlinetest.SQL(`CREATE TABLE invoices (order_id text PRIMARY KEY, amount_cents bigint NOT NULL)`),
		Handlers: map[string]consumer.HandlerFunc{"order.created": eventlinetest.JSON(invoice)},
		Events: []eventline.Event{
			orderEvent("order.created", "o-1", OrderCreated{ID: "o-1", AmountCents: 1250}),
			orderEvent("order.created", "o-2", OrderCreated{ID: "o-2", AmountCents: 990}),
		},
		State: eventlinetest.Rows(`SELECT order_id, amount_cents FROM invoices ORDER BY order_id`),
	})
	fmt.Println("error:", err)
	fmt.Println("failing schedule:", f)
	// Output:
	// error: <nil>
	// failing schedule: <nil>
}

// A handler that sends a notification outside its transaction (here: a
// row written on a connection of its own) sends it twice when its first
// attempt fails after sending. The kit finds the schedule that shows it.
func ExampleCheck_notIdempotent() {
	notify := func(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderCreated) error {
		conn, err := pgx.ConnectConfig(ctx, tx.Conn().Config().Copy()) // not the consumer transaction
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, `INSERT INTO notifications (order_id) VALUES ($1)`, o.ID)
		return err
	}
	f, err := eventlinetest.Check(context.Background(), eventlinetest.Case{
		Setup:    eventlinetest.SQL(`CREATE TABLE notifications (order_id text NOT NULL)`),
		Handlers: map[string]consumer.HandlerFunc{"order.created": eventlinetest.JSON(notify)},
		Events:   []eventline.Event{orderEvent("order.created", "o-1", OrderCreated{ID: "o-1", AmountCents: 1250})},
		State:    eventlinetest.Rows(`SELECT order_id, count(*) FROM notifications GROUP BY order_id`),
	})
	fmt.Println("error:", err)
	fmt.Println("caught by:", f.Tests)
	fmt.Println(f.Minimal[0])
	fmt.Println("want", f.Want, "got", f.Got)
	// Output:
	// error: <nil>
	// caught by: handler errors
	// the handler's first run for order/o-1 v1 (order.created) fails after it ran, and the event is retried
	// want [o-1 | 1] got [o-1 | 2]
}
