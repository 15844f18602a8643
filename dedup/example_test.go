package dedup_test

import (
	"errors"
	"fmt"

	"github.com/eventline/eventline/dedup"
)

// Two events of one aggregate carrying one event id: the second is not a
// duplicate but an id conflict, refused (dead-lettered with this reason,
// kind id_conflict) instead of being skipped.
func ExampleIDConflictError() {
	var err error = &dedup.IDConflictError{Group: "billing", EventID: "evt-1",
		Event:    dedup.Record{EventType: "order.paid", AggregateType: "order", AggregateID: "o-1", AggregateVersion: 3},
		Recorded: dedup.Record{EventType: "order.created", AggregateType: "order", AggregateID: "o-1", AggregateVersion: 1}}
	fmt.Println(errors.Is(err, dedup.ErrIDConflict), err.(interface{ DeadLetterKind() string }).DeadLetterKind())
	// Output:
	// true id_conflict
}
