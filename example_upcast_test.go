package eventline_test

import (
	"fmt"

	"github.com/eventline/eventline"
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
