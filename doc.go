// Package eventline holds the event envelope shared by every part of the
// eventline pipeline: the [Event] type, the metadata keys it travels with, and
// the single [Encode]/[Decode] pair that turns an Event into a Watermill
// message and back; [DecodePayload] reads a JSON payload, and [Upcasters]
// bring older payload schema versions to the current one.
//
// The pipeline itself lives in sub-packages:
//
//   - producer: PublishTx writes events into an outbox in the caller's pgx
//     transaction (watermill-sql), and the Relay forwards them to Kafka keyed
//     by aggregate id.
//   - middleware, dedup, versioning: Watermill handler middleware that runs a
//     handler in a consumer-side transaction, records each event id once, and
//     applies each aggregate's versions in order.
//   - consumer: a ready runner around that middleware.
//   - migrations: the embedded, numbered SQL schema.
//   - eventlinetest: a test kit that runs your handlers under duplicates,
//     reordering, crashes and rebalances; eventlinetest/kafkatest starts an
//     in-process Kafka for your tests.
//
// Delivery is at-least-once on every hop; effects are applied once because the
// dedup record and the version advance commit in the same transaction as the
// handler's writes.
package eventline
