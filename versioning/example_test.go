package versioning_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/versioning"
)

// The gate's policies are set on the middleware's Config (the consumer's
// Config embeds it): park early events, except for a type whose events
// are "newer wins"; hold late events, except for additive ones.
func Example() {
	cfg := middleware.Config{
		Group:            "billing",
		GapPolicy:        versioning.Park,
		PolicyByType:     map[string]versioning.GapPolicy{"account.limit_set": versioning.Apply},
		LatePolicy:       versioning.HoldLate,
		LatePolicyByType: map[string]versioning.LatePolicy{"account.credited": versioning.ApplyLate},
		ParkTimeout:      30 * time.Minute, // give gaps up sooner than versioning.DefaultParkTimeout
	}
	fmt.Println(cfg.GapPolicy, cfg.PolicyByType["account.limit_set"], versioning.DefaultParkTimeout)
	// Output:
	// park apply 1h0m0s
}

// An event whose version would leave more versions missing than MaxGap is
// refused: its version is probably inflated. The dead letter's reason says
// what to check.
func ExampleGapTooLargeError() {
	var err error = &versioning.GapTooLargeError{AggregateType: "order", AggregateID: "o-7", EventID: "evt-9",
		Version: 1_000_001, Previous: 1_000_000, Known: 3, MaxGap: versioning.DefaultMaxGap}
	fmt.Println(errors.Is(err, versioning.ErrGapTooLarge))
	fmt.Println(err)
	// Output:
	// true
	// eventline: aggregate order/o-7: event evt-9 (v1000001, follows v1000000) would leave versions 4..1000000 (999997) missing, more than MaxGap 1000: its version is probably inflated; fix the producer. If the gap is genuine, raise MaxGap and replay the dead letter
}
