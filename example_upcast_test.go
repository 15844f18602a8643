package eventline_test

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/middleware"
)

// An order.created payload written as version 1 reaches a handler written
// for version 3; a version-4 payload is refused.
func ExampleUpcasters_Upcast() {
	up, err := eventline.NewUpcasters(map[string]int{"order.created": 3},
		eventline.Upcaster{Type: "order.created", From: 1, Func: renameAmount}, // v1 {"amount"} → v2 {"amount_cents"}
		eventline.Upcaster{Type: "order.created", From: 2, Func: addCurrency},  // v2 → v3, adds "currency"
	)
	if err != nil {
		panic(err)
	}
	old := eventline.Event{ID: "e-1", Type: "order.created", SchemaVersion: 1, Payload: []byte(`{"amount":1250}`)}
	e, err := up.Upcast(old)
	fmt.Println(e.SchemaVersion, string(e.Payload), err)

	_, err = up.Upcast(eventline.Event{ID: "e-2", Type: "order.created", SchemaVersion: 4, Payload: []byte(`{}`)})
	fmt.Println(err)
	// Output:
	// 3 {"amount_cents":1250,"currency":"EUR"} <nil>
	// eventline: event e-2 (order.created) has payload schema version 4, newer than this consumer's current version 3: deploy a consumer whose handler reads version 4 (with an upcaster from 3), then replay the dead letter
}

// readmeUpcasting is the README's upcasting snippet.
func readmeUpcasting(pool *pgxpool.Pool, router *message.Router, sub message.Subscriber, el *middleware.Eventline, handler message.NoPublishHandlerFunc) error {
	up, err := eventline.NewUpcasters(map[string]int{"order.created": 3},
		eventline.Upcaster{Type: "order.created", From: 1, Func: renameAmount}, // v1 {"amount"} → v2 {"amount_cents"}
		eventline.Upcaster{Type: "order.created", From: 2, Func: addCurrency},  // v2 → v3, adds "currency"
	)
	if err != nil {
		return err
	}

	// The ready runner: every handler gets version 3.
	c, err := consumer.New(pool, consumer.Config{Group: "billing", Topics: []string{"orders"}, Upcasters: up})

	// Your own Router: upcast inside the eventline middleware.
	router.AddConsumerHandler("billing", "orders", sub, handler).
		AddMiddleware(el.Middleware, middleware.Upcast(up))

	_ = c
	return err
}

var _ = readmeUpcasting
