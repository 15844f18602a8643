// Package consumer is a ready runner for eventline consumers: it reads
// events from Kafka and applies each one exactly once, in per-aggregate
// order, in a PostgreSQL transaction, with handlers registered per event
// type.
//
//	c, err := consumer.New(pool, consumer.Config{Config: middleware.Config{Group: "billing"}, Topics: []string{"orders"}})
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
//     held for the operator (`eventline held list -kind late`) or, under
//     Config.LatePolicy ApplyLate, applied marked late. An event that
//     would park must pass its handler's checks first (HandleJSON: the
//     payload decodes; WithValidate), else it is dead-lettered at once.
//     See package versioning and Config.GapPolicy.
//   - Failures are contained, and told apart (see the middleware
//     package's "Three kinds of failure"): a handler error or panic rolls
//     everything back; the event is retried (Config.MaxRetries, on
//     Config.Retry's schedule) and then dead-lettered; a message that can
//     never succeed (an unknown event type, a payload that does not decode,
//     errors wrapped with middleware.Permanent…) is dead-lettered at once.
//     Either way the partition moves on.
//   - A database outage never dead-letters anything: events wait, spend
//     none of their retry budget, and the consumer resumes by itself when
//     the database answers again. One warning marks the start of an outage
//     and one line its end; eventline_consumer_waiting_on_database is above
//     0 meanwhile.
//   - Dead letters are kept whole in the consumer's own database (see the
//     middleware package's "Dead letters"), so no record can stall its
//     partition by failing; `eventline held list|replay|discard` inspects,
//     replays or gives up on them.
//   - Graceful shutdown: when Run's context ends, events in flight finish
//     (or, after Config.ShutdownTimeout, roll back), offsets of finished
//     events are committed, and Run returns with no goroutine or connection
//     of its own left behind.
//
// # Lanes and batches
//
// A partition is not handled one event at a time: its events are spread
// over Config.Lanes lanes (default 8) by aggregate, and lanes run
// concurrently, so a slow handler (an HTTP call, say) scales with lanes
// rather than with partitions. One aggregate's events stay in one lane, in
// offset order. Within a lane, the events that queued up while the lane was
// busy, up to Config.BatchSize (default 16), are applied in one PostgreSQL
// transaction: BEGIN and every event's dedup record and version check in one
// round trip, the handlers one after the other, one COMMIT, then the
// offsets. Every guarantee above holds per event; an event whose handler
// fails or panics costs only itself (the others of its batch commit
// without it, and it follows its own retries and dead-lettering). The
// committed Kafka offset is always the lowest one not finished, so it never
// passes an event whose transaction has not committed (size the pool for
// the lanes, see below). Config.BatchLinger makes a lane wait for fuller
// batches. Lanes and
// BatchSize both 1 restore one event per partition at a time.
//
// A lane that holds a single event with nothing behind it (the usual case
// at moderate rates, when every lane receives one event at a time) does
// not apply it in a transaction of its own when the consumer is busy: it
// hands the event to its topic's coalescer. The coalescer delivers up to
// min(the pool's MaxConns, max(Config.Lanes, 2 × GOMAXPROCS)) such events
// at once; while one of those slots is free, an event is applied alone and
// at once, so an idle consumer adds no latency. When every slot is busy,
// single events wait in arrival order, and the next slot that frees takes
// up to Config.BatchSize of them, of any lanes and partitions of the
// topic, and applies them in one transaction, as a lane's batch (the same
// guarantees: per-event failures, lock order, one aggregate's events in
// order). A lane waits for its event's outcome as if it had applied it, so
// one aggregate never has two events in flight and offsets are committed
// as above; a nacked event is retried by its lane. Events still waiting
// for a slot when their partition is revoked or the consumer stops are
// withdrawn unapplied (their offsets are not committed) and redelivered.
// BatchSize 1 turns this off.
//
// A new consumer group starts at the oldest offset, so a consumer deployed
// after events were published still sees them.
//
// # The consumer's pool
//
// Config.TxTimeout (1 minute by default) is how the consumer notices a
// database connection that stops answering without closing (a frozen or
// vanished host): the attempt is abandoned and, if the database does not
// answer a probe either, treated as an outage. Configure the pool so that
// connecting is bounded too, and so that the server releases the locks of
// a session whose client vanished:
//
//	cfg, err := pgxpool.ParseConfig(url)
//	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
//	cfg.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "2min" // at least 2 × TxTimeout
//	pool, err := pgxpool.NewWithConfig(ctx, cfg)
//
// Size it for the lanes: each lane runs one transaction at a time, and the
// sweeper and dead-letter replays take one connection each, so
// partitions read by this instance × Config.Lanes + 2 connections let
// every lane run at once. A smaller pool is safe, only slower: lanes wait
// for a connection.
//
// Events of types nobody handles must be listed with Ignore, or they are
// dead-lettered and, since their version is then never applied, later
// events of their aggregate wait behind the gap.
//
// Consumer is the middleware package's chain (middleware.Eventline's
// AddHandler) on a Watermill Router, fed by a Kafka subscriber of its own
// that hands a lane's events out together (Watermill has no batch API), so
// the middleware applies them in one transaction. Teams with their own
// Router use the middleware package directly, one event per partition at
// a time.
//
// Tracing, metrics and logs are the middleware package's (see its
// documentation).
package consumer
