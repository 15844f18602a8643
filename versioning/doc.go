// Package versioning names the consumer's version gate's policies: what
// happens to an event that arrives ahead of a missing version of its
// aggregate ([GapPolicy]), to one whose version was given up on before it
// arrived ([LatePolicy]), and to one that carries no version
// ([UnversionedPolicy]); their defaults; and the gate's refusals a handler
// or an operator may meet ([GapTooLargeError], [ErrUnversioned],
// [ErrNoHandler]). middleware.Config (embedded by consumer.Config) is
// where they are set; the gate itself runs inside the middleware.
//
// # The gate
//
// Every event carries its aggregate's version and the version it follows:
// aggregate_previous_version on the wire when the producer skipped numbers
// on purpose, else version-1. Per consumer group and aggregate, the
// consumer's database holds the last applied version c. For each event
// (version v, following p), the gate locks that row (creating it race-free
// for a new aggregate, so concurrent first events cannot both apply) and
// decides, in the handler's transaction:
//
//   - v ≤ c: stale. The handler does not run. If v was given up on earlier
//     (recorded in skipped_versions) the event is late, see below;
//     otherwise it is discarded and counted (a redelivery whose dedup
//     record expired, or a second event claiming an applied version).
//   - p ≤ c < v: next. The event's predecessor is applied; the version
//     advances to v with the handler's writes. This includes p < c: an
//     event whose predecessor the aggregate has passed still applies, since
//     nothing it follows is missing.
//   - c < p: a gap, handled by the GapPolicy, per event type if needed:
//     [Park] (the default: store the event in parked_events and acknowledge
//     it) or [Apply] (newer wins: apply, jump the version and audit the
//     skipped range c+1..p in skipped_versions). The former Reject policy
//     is refused: retrying an early event blocked its partition, so the
//     missing version never arrived.
//
// No version arithmetic is done in SQL, so versions up to MaxInt64 are
// safe. A gap in front of an event that follows v-1 is bounded: such an
// event says nothing about the versions below v-1, so all of them count as
// missing, and one that would leave more than MaxGap missing
// ([DefaultMaxGap] is 1000) is refused with a permanent *GapTooLargeError,
// so an inflated version (a bad producer, a hand-made record) is
// dead-lettered instead of parking and, at the park timeout, skipping every
// genuine version in between. An event that declares its predecessor
// (aggregate_previous_version below v-1, as the producer writes it for
// sparse versions) waits for that one event however far back its number
// is: MaxGap does not apply to it.
//
// One aggregate, one topic: versions are allocated per aggregate, so a
// consumer group that reads only some of the topics an aggregate's events
// go to sees gaps it can never fill. The producer refuses to publish one
// aggregate to two topics; keep each aggregate type on one topic.
//
// Because the row lock is held until the transaction ends, the handlers of
// one aggregate never run concurrently, in one process or across a consumer
// group, and a version is only ever advanced together with the effects of
// the event that advanced it.
//
// # Parked events
//
// When the missing version is applied, the parked successors whose
// predecessor is now applied are applied right away, in version order, in
// the same transaction; each runs in a savepoint, so a failing one is
// rolled back alone, its failure is recorded, draining stops, and the
// sweeper retries it later on the release backoff. A parked event that
// fails MaxReleaseAttempts times ([DefaultMaxReleaseAttempts], 10, over
// about 20 minutes with [DefaultReleaseBackoff]), or with a permanent
// error, is given up: its version is recorded in skipped_versions, the
// aggregate moves past it, and it is held with the late events (cause
// release_failed).
//
// The sweeper (the middleware's Run) visits aggregates whose lowest parked
// event is due (ready, or behind a gap older than the park timeout, and
// past its release backoff), those due longest first, each in its own
// transaction holding the aggregate's row lock. When an aggregate's oldest
// parked event has waited longer than the park timeout it gives up on the
// gap: in one savepoint with the first parked event's application, it
// records the missing versions in skipped_versions and moves the version to
// that event's predecessor. The park timeout counts from the sweeper's own
// start and from the end of its last failed pass too, so a consumer back
// from an outage catches up with Kafka before it gives up on any gap. The
// default, [DefaultParkTimeout], is an hour: the operator's window to
// replay a lost event so that it applies in order. Operators can give up on
// a gap at once with `eventline parked release`.
//
// # Late events
//
// An event is late when it was received but never applied and its
// aggregate has passed its version: it arrived after its version was given
// up on, it was parked and the aggregate moved past it, or it was a parked
// event given up after its release attempts. It is never dropped silently.
// By the LatePolicy (per event type):
//
//   - [HoldLate] (the default): the event is held for the operator
//     (held_events, kind late), its dedup outcome is late and it is
//     counted; an operator lists it (admin.ListHeld, `eventline held list
//     -kind late`), then replays it (admin.ReplayHeld, `eventline held
//     replay`: the consumer's sweeper runs the handler, marked late) or
//     discards it (admin.DiscardHeld, `eventline held discard`). The dedup
//     record makes redeliveries duplicates and does not block the replay.
//   - [ApplyLate]: the handler runs at once, marked late
//     (middleware.IsLate), for handlers that can apply an event after
//     later ones.
//
// A replayed consumer dead letter whose version its aggregate passed
// meanwhile is held the same way (cause version_conflict), whatever the
// late policy: it was never applied, so it is not a duplicate to drop.
// `eventline held replay` (admin.ReplayHeld) warns when it replays a relay
// dead letter whose version a consumer group already gave up on.
package versioning
