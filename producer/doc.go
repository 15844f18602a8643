// Package producer is the writing half of eventline: the transactional
// outbox and the relay that empties it into Kafka.
//
// [Producer.PublishTx] writes events in the caller's own pgx transaction,
// in one round trip, as rows in watermill-sql's table format holding
// Watermill's forwarder envelope. Events are spread over the outbox's
// shards by a stable hash of their aggregate, so one aggregate's events
// always share a shard and a Kafka topic, and their versions follow each
// other. [Producer.PublishAndCommit] sends the outbox statement with
// COMMIT, one round trip fewer.
//
// The [Relay] runs one Watermill forwarder per shard it owns, moving rows to
// Kafka keyed by aggregate id. Relays share the shards through leases in
// PostgreSQL and take over those of a relay that vanishes within
// [TakeoverBound]. Delivery is at-least-once: a crash after Kafka accepted
// a message but before the outbox recorded it sends the message again.
//
// The admin package holds every operator action: status, dead letters,
// cleanup, and the repairs after moving the database
// (admin.RebasePositions) or a failover that lost commits
// (admin.AdvanceSequences).
//
// Tracing: PublishTx stores the caller's trace context with each event
// ([Config.Propagator]); a relay given [RelayConfig.TracerProvider] sends
// each event as a child span of it, and the consumer continues the trace.
package producer
