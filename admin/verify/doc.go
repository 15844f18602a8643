// Package verify checks an eventline pipeline's guarantees against its
// data: the outbox and the relay's dead letters, what Kafka holds, and each
// consumer group's dedup records, versions, parked events and skipped gaps.
// It backs `eventline verify`, which runs it as a canary; an operator's
// own code can call Run too.
//
// # What is reconciled
//
// For every outbox event in the window (by the time its row was written),
// and every consumer group that consumes its topic, the event is exactly
// one of:
//
//   - recorded: the group has a processed_events row (applied, stale,
//     parked…), counted per outcome;
//   - dead-lettered: by the relay or by the group (held_events of kind
//     relay_dead_letter or dead_letter, not replayed); each dead letter
//     is a problem of its own;
//   - skipped: a skipped_versions range of the group covers its version
//     (each range is a warning of its own);
//   - pending: not relayed yet (or waiting for a relay retry), or relayed
//     and not consumed by the group yet (on Kafka at or after its committed
//     offset). Pending is information until the event is older than
//     Config.MaxPendingAge, then a problem (stuck);
//   - lost, a problem: relayed, not recorded, and the group has moved past
//     it: its aggregate version is at or beyond the event's, or its
//     committed Kafka offset is beyond the event's record (and the event
//     is not in its dead letters), or the event is not on Kafka at all
//     although nothing was deleted from the topic;
//   - unverifiable: not recorded, committed before the dedup horizon (now
//     minus Config.DedupRetention), so retention may have deleted the
//     record; counted, never reported as lost.
//
// Besides, per group: events applied out of order (a version applied after
// a higher one of its aggregate), events applied twice (from the group's
// own effects, when Config.EffectsQueries has a query for it), events
// discarded as stale while another event had been applied at their
// version (the stale outcome is checked, not trusted), parked events (a
// problem once older than Config.MaxParkedAge) and skipped gaps.
//
// # How, and at what cost
//
// Kafka offsets are fetched first, then the database snapshots are taken
// (the consumer's first), then Kafka's high watermarks: so every event the
// snapshot shows as relayed is below the watermarks read, and every offset
// a group committed covers only events whose records the snapshot shows.
// No false "lost" can come from the order of reading.
//
// With the consumer tables in the outbox's database (the default), the
// reconciliation is one set-based statement per shard: an anti-join of the
// outbox rows with processed_events, which returns only the events a group
// has no record of. With a separate consumer database the outbox rows are
// streamed and looked up there in chunks. Kafka records are indexed as 32
// bytes each (a digest of the event id and the record's position), about
// 32 MB per million records; nothing else grows with the data.
//
// Reads run in REPEATABLE READ READ ONLY transactions, which take no
// transaction id and so do not hold back the relays (they read only below
// the oldest running transaction id); a long run does hold back VACUUM
// for its duration.
//
// # Limits
//
//   - Retention: outbox rows deleted by cleanup are not checked (the window
//     cannot reach before them); an event without a dedup record committed
//     before the dedup horizon is unverifiable. Pass the dedup retention
//     cleanup really runs with: a shorter one makes old events look lost.
//   - Events are matched to groups by topic. Without Config.GroupTopics, a
//     group's topics are those its Kafka consumer group (of the same name)
//     committed offsets for, else those of the events it has records of; a
//     group that has consumed nothing from a topic yet is not expected to.
//   - Out-of-order needs two clocks to agree: processed_at and the
//     transaction that last wrote the dedup row (its xmin, compared by
//     age). An event released from parking is not reported, but an event
//     whose dedup row is older than about two billion transactions cannot
//     be compared. An effects query with an ordering column is exact.
//   - Kafka: absence proves nothing on a compacted topic; on a topic Kafka
//     deleted records from, only for events committed after the oldest
//     retained record. Topics read are the groups' topics.
//   - Clocks: outbox created_at is read in this session's time zone (as
//     `eventline cleanup` does); timestamps from different databases and
//     from Kafka are compared with a minute of slack.
package verify
