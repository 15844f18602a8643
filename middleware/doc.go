// Package middleware makes a Watermill handler apply each eventline event
// once, in per-aggregate order, in a PostgreSQL transaction. It works on any
// message.Router with any subscriber; the consumer package is a ready runner
// built on it, configured with the same [Config].
//
//	el, err := middleware.New(pool, middleware.Config{Group: "billing"})
//	_, err = el.AddHandler(router, "billing", "orders", kafkaSubscriber, onOrder)
//	go el.Run(ctx) // parked events, and dead letters replayed on request
//
// # The chain
//
// [Eventline.AddHandler] adds a handler to your Router inside the one safe
// chain, outermost first:
//
//	dead letters ▸ retries ▸ Config.Middleware ▸ the eventline transaction ▸ your handler
//
// The eventline transaction, for each message: it decodes the event (a
// message without an event id, with a non-numeric or negative version… never
// reaches the handler and fails with a permanent error); begins a
// transaction on the consumer's pool and, in the same round trip, records
// the event id within its aggregate in processed_events and locks, checks and
// advances the aggregate's version in one statement; runs the version gate's
// decision (see package versioning): apply, discard a duplicate or a stale
// event, hold a late one, or park an early one, draining parked successors
// once the missing version is applied; runs the handler with the transaction
// and the event in the message context ([TxFromContext],
// [EventFromContext]); and commits before the router acknowledges the
// message. Per event on the hot path the database sees BEGIN and that
// statement in one round trip, the handler's own statements, and COMMIT: as
// many round trips as a bare handler in its own transaction. Any error or
// panic rolls back everything, the dedup record included, so the message is
// retried as if it had never been seen.
//
// [Eventline.MiddlewareFor] is the eventline transaction alone, for one
// handler of your Router; errors then come back to the Router as they are.
//
// # Batches
//
// Watermill runs each message through the chain on its own goroutine and has
// no batch API. The consumer package's subscriber hands a lane's waiting
// events out together, as members of one batch: the middleware then holds
// each member that reaches it until the batch is complete and applies them
// all in one transaction: BEGIN and every member's dedup-and-gate statement
// in one round trip, the gate's decision and the handler for each member in
// order, one COMMIT. Per-event semantics do not change (a member that parks
// or drains cuts the batch before the next member of its aggregate; one that
// fails costs only itself). A message without a batch takes the one-event
// path.
//
// # Three kinds of failure
//
// Every error is one of three kinds, and each is handled its own way:
//
//   - the event's fault ([IsPermanent]: it does not decode, no handler
//     knows its type, its content breaks a database limit or does not fit
//     the handler's columns (SQLSTATE class 22 or 54, or a value pgx
//     cannot encode for its column), or the handler wrapped its error with
//     [Permanent]; the gate's refusals too: id conflicts, inflated versions,
//     events that fail Validate, all counted in
//     eventline_consumer_events_refused_total): dead-lettered at once;
//   - the infrastructure's ([IsInfrastructure]: PostgreSQL unreachable,
//     restarting, out of resources, not answering within Config.TxTimeout,
//     a commit whose outcome is unknown): never dead-lettered and never
//     counted against the budget; the consumer waits for the database on
//     Config.InfraBackoff's schedule and tries again;
//   - the handler's, maybe transient (anything else): retried on
//     Config.Retry's schedule, Config.MaxRetries times, then dead-lettered.
//     Transaction conflicts ([IsConflict]) are retried without spending the
//     budget.
//
// The middleware gives each failure its verdict: a timeout or a lost
// connection under the handler is an outage only if the database does not
// answer a probe either; otherwise it was the handler's own.
//
// # Dead letters
//
// What the chain gives up on is held, whole, in held_events (kind
// dead_letter) in the consumer's own database, in its own transaction; a
// message is never acknowledged without its row. [Eventline.Run] replays
// the dead letters an operator asked to replay (`eventline held replay`,
// admin.ReplayHeld), per aggregate in version order, through the handler
// they arrived on.
//
// Do not add Watermill's PoisonQueue or Retry to a router running eventline
// handlers, and never use Watermill's Deduplicator middleware: it remembers
// a message before the handler runs and drops its redelivery after a
// failure. A poison queue inside the eventline transaction (a handler
// middleware added after MiddlewareFor) would acknowledge a failed handler
// as a success; the middleware detects it and refuses the event with a
// *CompositionError: nothing is committed, the refusal is logged and
// counted, and the event waits until the chain is fixed. Never test
// ordering with gochannel, which reorders messages.
//
// # Parked events and the handler registry
//
// Events parked behind a missing version are applied later by the sweeper
// ([Eventline.Run], or one pass with [Eventline.Sweep]) through the handler
// they arrived on, with a savepoint of the sweeper's transaction in the
// context. The middleware finds that handler by Watermill handler name
// (recorded with the parked event): AddHandler and MiddlewareFor register it
// under its name; a handler is also learned when it handles a message; and
// when a name is unknown and exactly one handler was wrapped, that one is
// used.
//
// A parked event whose handler cannot be found, or fails, is retried and
// finally given up as package versioning describes; so are late events
// held or applied ([IsLate]).
//
// Messages a handler returns while a parked event is released by the sweeper
// cannot be published and are dropped with a warning; emit events from
// handlers with the producer's PublishTx through the transaction instead.
//
// # Effects outside the database
//
// [AfterCommit] runs a function after the consumer transaction commits, at
// most once; an external effect that must happen is published as a
// follow-up event through the producer's outbox in the consumer
// transaction instead (see Example_outboxFollowUp).
//
// # Tracing
//
// With Config.TracerProvider set, each delivery gets a "process <topic>"
// span (kind consumer, outermost in the chain) continuing the trace the
// record's headers carry, so one trace runs from the span PublishTx
// captured, through the relay's "send <topic>" span, to the handler, whose
// context carries the span: spans it starts nest under it. The span carries
// OpenTelemetry's messaging attributes (system, destination, message id,
// partition, offset, consumer group) and eventline's: event type, aggregate
// type, id and version, and eventline.outcome (applied, duplicate, stale,
// parked, skipped for a late event held, dead_lettered). A parked event
// applied later runs in a "release <topic>" span (outcome released) under
// the span of whatever released it (the event that filled the gap, or none
// in the sweeper), linked to the trace it arrived with; a dead letter is
// written in a "dead_letter <topic>" span. Each retry is an
// "eventline.retry" event on the process span, with the attempt that
// failed, the kind (handler, conflict, infrastructure, unsafe_composition),
// the wait and the error (cut to 1 KiB of valid UTF-8). Without a
// TracerProvider nothing is traced. Stage latencies (relayed_to_applied,
// occurred_to_applied, parked_to_released) go to
// eventline_consumer_stage_seconds and, with Config.MeterProvider, to the
// OTel histogram eventline.stage.duration.
//
// # Metrics and logs
//
// [NewMetrics] creates Prometheus collectors (applied, duplicates, stale,
// parked, parked now, released, release failures, given up, late, late held
// now, late applied, gaps skipped, refused, handler latency, dead-lettered,
// retries, waits for the database and events waiting on it now, failed
// dead-letter writes, replays, unsafe compositions, AfterCommit panics,
// stage and gap latencies); a nil *Metrics records nothing. Everything is
// logged through *slog.Logger.
package middleware
