// Package dedup records which events a consumer group has handled, so an
// event redelivered by Kafka (or re-sent by the relay) changes nothing the
// second time.
//
// # How it works
//
// Each consumer group has one row per event id and aggregate in
// processed_events, primary key (consumer_group, event_id, aggregate_type,
// aggregate_id). The row is written with
// INSERT … ON CONFLICT DO NOTHING in the same transaction as the handler's
// own writes: when the insert affects no row, the event is a duplicate and
// the handler is skipped. Because the row commits or rolls back together
// with the handler's effects, a handler error or a crash before commit
// leaves no row behind and the redelivered event is handled normally; a
// crash after commit but before the Kafka offset is committed makes the
// redelivered event a duplicate. Concurrent deliveries of one event (two
// consumers during a rebalance) serialize on the primary key: the second
// insert waits for the first transaction and then affects no row.
//
// Every row also records its outcome (see [Outcome]): applied, stale (the
// version gate discarded it), parked (it waits in parked_events for a
// missing version; it becomes applied when it is released), late (it is
// held as late in held_events for an operator), late_applied or
// late_discarded. A [Record] is what a row says.
//
// # Scope: the id within its aggregate
//
// An event id is unique per event, but a consumer cannot tell a genuine
// event from a record that reuses its id. The id is therefore recorded per
// aggregate: a record that carries a genuine event's id for another
// aggregate is a different event of that aggregate (gated on its own
// version there) and costs the genuine event nothing, whichever of the two
// is recorded first. Within one aggregate the row also records the event's
// identity (type, version): a hit whose identity differs is not a
// duplicate but an id conflict, two events of the aggregate share one id,
// and the event is refused with a permanent *IDConflictError instead of
// being skipped. The insert returns the recorded identity in the same
// statement, so the check costs no extra round trip. Events without an
// aggregate version still name an aggregate (the envelope requires one)
// and are scoped by it the same way.
//
// The middleware runs this for you, folding the insert into the version
// gate's statement so it costs no extra round trip.
//
// # Dead letters
//
// The messages a consumer group gives up on are held in held_events (kind
// dead_letter), in the same database, with their cause ([KindPermanent],
// [KindRetriesExhausted]…); the middleware package's documentation says
// how they are written and replayed.
//
// # Retention
//
// processed_events grows by one row per event. `eventline cleanup`
// deletes rows older than a retention window ([DefaultRetention], at least
// [MinRetention]) in bounded batches with a pause between them, so it never
// deletes fast enough to hold long locks. Rows whose outcome is parked or late are kept: their
// event is still waiting.
//
// Retention must exceed the longest time after which the broker can
// redeliver an event: the Kafka topic's retention (a consumer group reset
// to the oldest offset replays that far back), plus the outbox relay's
// retry and dead-letter replay window. A redelivery that arrives after its
// dedup row expired is no longer recognised here, but the version gate
// (package versioning) still rejects it: its aggregate version is not
// greater than the aggregate's current version, so it is discarded as
// stale and its handler does not run. Only events without an aggregate
// version rely on dedup alone; keep retention long for consumers of such
// events.
package dedup
