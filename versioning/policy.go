package versioning

import (
	"time"

	"github.com/eventline/eventline"
)

// GapPolicy says what the gate does with an event whose predecessor has not
// been applied yet (a gap: the aggregate's current version is below the
// event's previous version).
type GapPolicy string

// The gap policies.
const (
	// Park stores the event in parked_events and acknowledges it; it is
	// applied once the missing versions are, or given up on (see the
	// package documentation, "Parked events"). The default.
	Park GapPolicy = "park"
	// Apply applies the event at once ("newer wins"): the version jumps
	// and the skipped range is recorded in skipped_versions. Late arrivals
	// of the skipped versions are then late events (see [LatePolicy]).
	Apply GapPolicy = "apply"
	// Reject is no longer supported: retrying an early event blocks its
	// partition, so the missing version behind it never arrives and one
	// inversion became the permanent loss of the aggregate. A
	// configuration naming it is refused; use Park (with a shorter park
	// timeout if gaps should be given up on sooner).
	//
	// Deprecated: use Park.
	Reject GapPolicy = "reject"
)

// UnversionedPolicy says what the gate does with an event that carries no
// aggregate version.
type UnversionedPolicy string

// The policies for events without an aggregate version.
const (
	// PassUnversioned hands the event to the handler without any ordering
	// check; it is still deduplicated. The default.
	PassUnversioned UnversionedPolicy = "pass"
	// RejectUnversioned fails the event with ErrUnversioned, a permanent
	// error: it is dead-lettered without retries.
	RejectUnversioned UnversionedPolicy = "reject"
)

// LatePolicy says what the gate does with a late event: one whose version
// was given up on (recorded in skipped_versions, by the sweeper after the
// park timeout, by the Apply policy or by an operator) before the event
// arrived or could be applied. Later versions of its aggregate have been
// applied since, so applying it now is out of order.
type LatePolicy string

// The late policies.
const (
	// HoldLate holds the event for the operator (see the package
	// documentation, "Late events"); the handler does not run. The
	// default.
	HoldLate LatePolicy = "hold"
	// ApplyLate runs the handler at once with the event marked late
	// (middleware.IsLate reports true), for handlers that can apply an
	// event after later ones (set-if-newer updates, additive counters).
	ApplyLate LatePolicy = "apply"
)

// Defaults for the gate and the sweeper (of middleware.Config, which the
// consumer's Config embeds).
const (
	// DefaultGapPolicy is used when no gap policy is configured.
	DefaultGapPolicy = Park
	// DefaultLatePolicy is used when no late policy is configured.
	DefaultLatePolicy = HoldLate
	// DefaultUnversionedPolicy is used when no policy for events without
	// a version is configured.
	DefaultUnversionedPolicy = PassUnversioned
	// DefaultParkTimeout is how long an aggregate's oldest parked event
	// waits for the missing versions before the sweeper skips the gap.
	//
	// It is the operator's window to repair a lost event in order. The
	// relay dead-letters an event after RelayConfig.MaxAttempts (5) failed
	// publishes, waiting Backoff 1s+5s+30s+2m = 156s (about 2.6 minutes)
	// between them; its aggregate's later events are behind it in the same
	// outbox shard, so they reach Kafka, and park, only then. A consumer
	// dead-letters a failing event after its retries (seconds). Either
	// way the park timeout starts about when the dead letter appears: an
	// hour lets an operator paged by it fix the cause and replay the
	// dead letter (`eventline held replay`) so that it is applied in order.
	// A replay after the timeout is not lost: the event arrives late and
	// is held for the operator (see LatePolicy). The cost is that the
	// aggregate's later events wait, parked, for up to that hour.
	DefaultParkTimeout = time.Hour
	// DefaultSweepInterval is the pause between two sweeper passes.
	DefaultSweepInterval = 5 * time.Second
	// DefaultSweepBatch is the most aggregates one sweeper pass visits.
	DefaultSweepBatch = 500
	// DefaultMaxGap bounds the versions one event that follows v-1 may
	// leave missing in front of it (see the package documentation, "The
	// gate"). A genuine gap is one missing event per event lost upstream
	// (each lost event has its own dead letter), or a few in flight during
	// an xid inversion, far below 1000. A version inflated by a bad
	// producer or a hand-made record (1,000,000; MaxInt64) is far above it
	// and is refused as permanent instead of parking and, after the
	// timeout, skipping every genuine later version. An inflated version
	// within the bound can skip at most 1000 real versions, and those then
	// arrive late and are held, not lost.
	DefaultMaxGap int64 = 1000
	// DefaultMaxReleaseAttempts is how many times a parked (or late) event
	// whose turn has come is tried before the sweeper gives up on it: a
	// parked event is then given up (held as late for the operator) and its
	// version audited as skipped; a late event whose replay keeps failing
	// is held again for the operator.
	DefaultMaxReleaseAttempts = 10
)

// DefaultReleaseBackoff is the wait between failed attempts to apply a
// parked event: 5s after the first, doubling up to 5m. With
// DefaultMaxReleaseAttempts the 10 attempts span 5+10+20+40+80+160+300+
// 300+300 s, about 20 minutes.
var DefaultReleaseBackoff = eventline.Backoff{Initial: 5 * time.Second, Max: 5 * time.Minute, Multiplier: 2}
