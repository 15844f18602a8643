package eventline_test

import (
	"fmt"

	"github.com/eventline/eventline"
)

func ExampleNewJSONEvent() {
	type OrderCreated struct {
		ID          string `json:"id"`
		AmountCents int64  `json:"amount_cents"`
	}
	e, err := eventline.NewJSONEvent("order.created", "order", "o-42", OrderCreated{ID: "o-42", AmountCents: 1250})
	if err != nil {
		panic(err)
	}
	fmt.Println(e.Type, e.AggregateType, e.AggregateID, string(e.Payload))

	back, err := eventline.DecodePayload[OrderCreated](e)
	fmt.Println(back.AmountCents, err)
	// Output:
	// order.created order o-42 {"id":"o-42","amount_cents":1250}
	// 1250 <nil>
}

func ExampleDecode() {
	e := eventline.Event{ID: "evt-1", Type: "order.paid", AggregateType: "order", AggregateID: "o-42", AggregateVersion: 2, Payload: []byte(`{}`)}
	msg, _ := eventline.Encode(e)
	msg.Metadata.Set(eventline.MetaAggregateVersion, "two")
	_, err := eventline.Decode(msg)
	fmt.Println(err)
	// Output: eventline: invalid event: aggregate_version "two": must be a positive integer
}
