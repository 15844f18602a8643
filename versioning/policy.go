package versioning

import (
	"fmt"
	"time"
)

// GapPolicy says what the gate does with an event whose aggregate version
// is more than one above the aggregate's current version (a gap: earlier
// versions have not been applied yet).
type GapPolicy string

// The gap policies.
const (
	// Park stores the event in parked_events and acknowledges it. When the
	// missing version is applied, the parked successors are applied in
	// order in the same transaction. After the park timeout the sweeper
	// gives up on the missing versions: it records them in
	// skipped_versions and applies what is parked. The default.
	Park GapPolicy = "park"
	// Apply applies the event at once ("newer wins"): the version jumps
	// and the skipped range is recorded in skipped_versions. Late arrivals
	// of the skipped versions are then stale.
	Apply GapPolicy = "apply"
	// Reject fails the event with a *GapError, so it is retried and, if
	// the gap persists, dead-lettered.
	Reject GapPolicy = "reject"
)

// DefaultGapPolicy is used when no policy is configured.
const DefaultGapPolicy = Park

// Valid reports whether p is a known policy ("" is not).
func (p GapPolicy) Valid() bool { return p == Park || p == Apply || p == Reject }

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

// DefaultUnversionedPolicy is used when no policy is configured.
const DefaultUnversionedPolicy = PassUnversioned

// Valid reports whether p is a known policy ("" is not).
func (p UnversionedPolicy) Valid() bool { return p == PassUnversioned || p == RejectUnversioned }

// Defaults for the sweeper.
const (
	// DefaultParkTimeout is how long an aggregate's oldest parked event
	// waits for the missing versions before the sweeper skips the gap. It
	// is longer than the outbox relay's retry schedule (about 13 minutes
	// before it dead-letters), so a version that is merely slow is not
	// given up on.
	DefaultParkTimeout = 15 * time.Minute
	// DefaultSweepInterval is the pause between two sweeper passes.
	DefaultSweepInterval = 5 * time.Second
	// DefaultSweepBatch is the most aggregates one sweeper pass visits.
	DefaultSweepBatch = 500
)

// Policies chooses a gap policy per event type.
type Policies struct {
	// Default applies to event types without an override. Defaults to
	// DefaultGapPolicy (Park).
	Default GapPolicy
	// ByType overrides Default for individual event types.
	ByType map[string]GapPolicy
}

// For returns the policy for an event type.
func (p Policies) For(eventType string) GapPolicy {
	if pol, ok := p.ByType[eventType]; ok && pol != "" {
		return pol
	}
	if p.Default == "" {
		return DefaultGapPolicy
	}
	return p.Default
}

// Validate returns an error naming the first unknown policy; field prefixes
// the names in the message (e.g. "consumer.Config").
func (p Policies) Validate(field string) error {
	if p.Default != "" && !p.Default.Valid() {
		return fmt.Errorf("%s.GapPolicy %q is unknown: use %q, %q or %q", field, p.Default, Park, Apply, Reject)
	}
	for typ, pol := range p.ByType {
		if typ == "" {
			return fmt.Errorf("%s.PolicyByType has an empty event type", field)
		}
		if !pol.Valid() {
			return fmt.Errorf("%s.PolicyByType[%q] %q is unknown: use %q, %q or %q", field, typ, pol, Park, Apply, Reject)
		}
	}
	return nil
}
