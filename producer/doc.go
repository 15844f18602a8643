// Package producer is the writing half of eventline: the transactional
// outbox and the relay that empties it into Kafka.
//
// [Producer.PublishTx] writes events in the caller's own pgx transaction,
// in one round trip, as rows in watermill-sql's table format holding
// Watermill's forwarder envelope (what watermill-sql's publisher wrapped in
// a forwarder publisher would store). Events are spread over the outbox's
// shards by a stable hash of their aggregate, so one aggregate's events
// always share a shard; they all go to one Kafka topic, and their versions
// follow each other (see PublishTx for the rules, and [DefaultMaxMessageBytes]
// for the size limit shared with the relay). [Producer.PublishAndCommit]
// runs the caller's function in a transaction of its own and sends the
// outbox statement with COMMIT, one round trip fewer;
// [Config.CallerVersionedTypes] lets aggregates whose version column the
// caller's transaction locks skip the per-aggregate sequence row.
//
// The [Relay] runs one Watermill forwarder per shard it owns, moving rows to
// Kafka keyed by aggregate id (partitioned with Kafka's own murmur2 hash).
// Several relay processes share the shards between them through leases in
// PostgreSQL; each shard is relayed by one of them at a time, and the
// shards of a relay that dies or vanishes are taken over within
// [TakeoverBound]. Relays need session-level connections (not a
// transaction-mode pooler) and a pool of [PoolSizeFor] connections. A
// Relay runs once ([ErrRelayRunning]): to restart one, let Run return and
// create a new one with [NewRelay]. Delivery is at-least-once: a crash after Kafka
// accepted a message but before the outbox recorded it means the message is
// sent again, never lost.
//
// After moving the database to another cluster, see admin.RebasePositions;
// after a failover that lost commits, admin.AdvanceSequences. The admin
// package holds every operator action (status, dead letters, cleanup).
//
// Tracing: PublishTx stores the caller's trace context (traceparent,
// tracestate, baggage) with each event; a relay given
// RelayConfig.TracerProvider records a "send <topic>" span per event as a
// child of it, Kafka's answer (partition and offset, or the error) on the
// span, and writes the send span's context into the record headers, where
// the consumer continues the trace.
package producer
