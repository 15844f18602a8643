// Package admin is what an operator does to a running pipeline, one
// function each: the CLI (`eventline status`, `relay rebase-positions`,
// `relay advance-sequences`, `cleanup`, `held`) calls these and holds no SQL
// of its own, and a service's admin endpoint can call them too.
//
// Look:
//   - [ReadStatus]: the outbox's backlog per shard, the relays owning the
//     shards, and every consumer group's parked events, open gaps, late
//     events, dead letters, dedup records and skipped gaps, in one snapshot
//     when run in a repeatable-read transaction; [ReadOutboxStatus] for the
//     outbox alone, [ShardOwners], [ReadHorizonHolder] for the transaction
//     holding committed events back; [FindOutboxVersions] for where the
//     outbox holds given aggregate versions (`eventline parked where`).
//   - [NewStatusCollector]: the same (outbox and groups) at every
//     Prometheus scrape.
//
// Act:
//   - [ListHeld], [ReplayHeld] and [DiscardHeld]: the events held for the
//     operator, of every kind (the relay's dead letters, the consumers'
//     dead letters, late events).
//   - [Cleanup]: outbox rows past retention (relays do it for their shards).
//   - After moving the database to another cluster, [CheckPositions] and
//     [RebasePositions]; after a failover that lost commits,
//     [AdvanceSequences].
//
// Every function validates its arguments (a nil handle, a schema that is
// not a plain SQL identifier) and names the one at fault. Functions that
// only read, or write in one statement, take a [DBTX] (a pool, a
// connection or the caller's transaction); those that run transactions of
// their own take a [Beginner].
package admin
