// Package consumer is a ready runner for eventline consumers: it reads
// events from Kafka and applies each one exactly once, in per-aggregate
// order, in a PostgreSQL transaction, with handlers registered per event
// type.
//
//	c, err := consumer.New(pool, consumer.Config{Group: "billing", Topics: []string{"orders"}})
//	consumer.HandleJSON(c, "order.created", func(ctx context.Context, tx pgx.Tx, e eventline.Event, o Order) error {
//		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id, total) VALUES ($1, $2)`, o.ID, o.Total)
//		return err
//	})
//	err = c.Run(ctx) // until ctx ends
//
// # What it guarantees
//
//   - Once-only effects: the handler's writes, the event's dedup record and
//     its aggregate's version advance commit in one transaction, before the
//     Kafka offset moves. A redelivery (after a crash, a rebalance, a relay
//     retry) finds the dedup record and does nothing.
//   - Per-aggregate order: events of one aggregate are applied in version
//     order; early ones are parked until the missing versions arrive (or,
//     after Config.ParkTimeout, until the sweeper gives up on them and
//     records the gap in skipped_versions), stale ones are discarded, and
//     late ones (their version was given up on before they arrived) are
//     held for the operator (`eventline parked late`) or, under
//     Config.LatePolicy ApplyLate, applied marked late. An event that
//     would park must pass its handler's checks first (HandleJSON: the
//     payload decodes; WithValidate), else it is dead-lettered at once.
//     See package versioning and Config.GapPolicy.
//   - Failures are contained: a handler error or panic rolls everything
//     back; the event is retried with exponential backoff
//     (Config.MaxRetries) and then sent to Config.DeadLetterTopic with the
//     reason in its metadata (DeadLetterReasonKey, DeadLetterKindKey…).
//     Messages that can never succeed (no event id, a malformed version, an
//     unknown event type, a payload that does not decode, errors wrapped
//     with middleware.Permanent) are dead-lettered at once. Either way the
//     partition moves on.
//   - Graceful shutdown: when Run's context ends, events in flight finish
//     (or, after Config.ShutdownTimeout, roll back), offsets of finished
//     events are committed, and Run returns with no goroutine or connection
//     of its own left behind.
//
// A new consumer group starts at the oldest offset, so a consumer deployed
// after events were published still sees them.
//
// With Config.Upcasters, every handler gets each event at the current
// payload schema version of its type, upcast just before it runs (also
// when a parked event is released); an event the upcasters cannot bring to
// that version is dead-lettered as permanent. See eventline.Upcasters.
//
// Events of types nobody handles must be listed with Ignore, or they are
// dead-lettered and, since their version is then never applied, later
// events of their aggregate wait behind the gap.
//
// Consumer is the middleware package's composed middleware on a Watermill
// Router with a watermill-kafka subscriber; teams with their own Router use
// that package directly.
package consumer
