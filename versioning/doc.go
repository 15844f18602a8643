// Package versioning is the consumer's version gate: it applies each
// aggregate's events in version order, once, whatever order the pipeline
// delivers them in.
//
// # The gate
//
// Every event carries its aggregate's version (1, 2, 3…). Per consumer group
// and aggregate, aggregate_versions holds the last applied version. For each
// event, [Store.Admit] locks that row (creating it race-free for a new
// aggregate with an upsert, so concurrent first events cannot both apply)
// and decides, in the handler's transaction:
//
//   - v ≤ current: Stale. The event is discarded and counted; its handler
//     does not run; its dedup outcome is stale.
//   - v = current+1: Next. The version advances with the handler's writes.
//   - v > current+1: a gap, handled by the [GapPolicy] configured for the
//     consumer, per event type if needed: Apply (newer wins: apply, jump the
//     version and audit the skipped range in skipped_versions), Park (store
//     the event in parked_events and acknowledge it) or Reject (fail with a
//     *GapError: retried, then dead-lettered).
//
// Events without an aggregate version pass through without ordering, or are
// rejected, by [UnversionedPolicy].
//
// Because the row lock is held until the transaction ends, the handlers of
// one aggregate never run concurrently, in one process or across a consumer
// group, and a version is only ever advanced together with the effects of
// the event that advanced it.
//
// # Parked events
//
// When the missing version is applied, the parked successors are applied
// right away, in order, in the same transaction ([Store.Drain]); each runs
// in a savepoint, so a failing one is rolled back alone, its failure is
// recorded (release_attempts, last_error), draining stops, and the
// [Sweeper] retries it later.
//
// The sweeper ([Store.NewSweeper], one pass with [Sweeper.Sweep], a loop with
// [Sweeper.Run]) visits aggregates with parked events, each in its own
// transaction holding the aggregate's row lock (skipping aggregates locked
// by a live consumer or another sweeper until the next pass). It applies
// parked events that are next in line but were not drained, and when an
// aggregate's oldest parked event has waited longer than the park timeout it
// gives up on the gap: it records the missing versions in skipped_versions,
// moves the version to just below the lowest parked event and applies what
// is parked, in order. So no parked event waits much longer than the park
// timeout plus one sweep interval, unless its own handler keeps failing.
//
// Operators can give up on a gap at once with [Store.ReleaseGap]
// (`eventline parked release`), which needs only the database; the running
// consumer's sweeper then applies the ready events. [Store.ListParked] and
// [Store.ListSkipped] back `eventline parked list` and the audit.
//
// The middleware package wires the gate into a Watermill handler chain and
// supplies the sweeper's ApplyFunc from its handler registry.
package versioning
