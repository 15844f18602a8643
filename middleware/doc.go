// Package middleware makes a Watermill handler apply each eventline event
// once, in per-aggregate order, in a PostgreSQL transaction. It works on any
// message.Router with any subscriber; the consumer package is a ready runner
// built on it.
//
// # The chain
//
// [New] returns the composed middleware. Outermost first, each message goes
// through:
//
//		recover ▸ tx ▸ decode ▸ dedup ▸ version gate ▸ handler
//
//	  - recover ([Recover]) turns a handler panic into a *PanicError: the
//	    transaction is rolled back and the message retried.
//	  - tx ([Tx]) begins a transaction on the consumer's pool and puts it in
//	    the message context ([TxFromContext]); it commits when the handler
//	    succeeds, before the router acknowledges the message, and rolls back
//	    on any error.
//	  - decode ([Decode]) reads the event with eventline.Decode
//	    ([EventFromContext]); a message without an event id, with a
//	    non-numeric or negative version… never reaches the handler and fails
//	    with a permanent error.
//	  - dedup ([Dedup]) records the event id, within its aggregate, in
//	    processed_events; a duplicate is acknowledged without running the
//	    handler. A recorded row that is a different event of the aggregate
//	    under the same id (another type or version) is an id conflict: a
//	    permanent *dedup.IDConflictError, never a silent skip. The id on
//	    another aggregate is another event, recorded on its own.
//	  - the version gate ([Gate]) locks the aggregate's version row and
//	    applies, discards (stale), holds (late) or parks the event (see
//	    package versioning), draining parked successors once the missing
//	    version is applied. Before an event may park or be held as late it
//	    must pass Config.Validate ([ValidateFunc]) and, unless it declares
//	    its predecessor, leave at most MaxGap versions missing; otherwise
//	    it is refused as permanent.
//
// In the composed middleware, dedup and the gate's lock, check and version
// advance are one SQL statement (on a duplicate it also returns the
// recorded event's identity, so an id conflict costs no extra round
// trip), sent in one batch with BEGIN
// (pgx.Batch.BeginTx). Per event on the hot path the database sees
// BEGIN + that statement in one round trip, the handler's own statements,
// and COMMIT: as many round trips as a bare handler in its own
// transaction. (The message is therefore decoded just before the
// transaction begins rather than just after; nothing else changes.) The
// pieces are also exported, to compose by hand (Tx{…}.Middleware, Decode,
// NewDedup(…).Middleware, NewGate(…).Middleware); the result is the same,
// with two more round trips.
//
// Any error rolls back everything, the dedup record included, so the
// message is redelivered or retried as if it had never been seen.
//
// # Batches
//
// Watermill runs each message through the chain on its own goroutine and
// has no batch API. A subscriber that hands several messages out at once
// can make them members of a [Batch]: the composed middleware then holds
// each member that reaches it until the batch is complete and applies them
// all in one transaction: BEGIN and every member's dedup-and-gate statement
// in one round trip, the gate's decision and the handler for each member in
// order, one COMMIT. Per-event semantics do not change (see [Batch] for how
// a member that parks, drains or fails is isolated). The consumer package's
// Subscriber does this per lane of a Kafka partition. A message without a
// Batch in its context takes the one-event path.
//
// # Three kinds of failure
//
// Every error is one of three kinds, and each is handled its own way:
//
//   - the event's fault ([IsPermanent]: it does not decode, no handler
//     knows its type, its content breaks a database limit or does not fit
//     the handler's columns (SQLSTATE class 22 or 54, or a value pgx
//     cannot encode for its column), or the handler wrapped its error with
//     [Permanent]; the gate's refusals too: id
//     conflicts, inflated versions, events that fail Validate, all counted
//     in eventline_consumer_events_refused_total): dead-lettered at once;
//   - the infrastructure's ([IsInfrastructure]: PostgreSQL unreachable,
//     restarting, out of resources, not answering within Config.TxTimeout,
//     a commit whose outcome is unknown): never dead-lettered and never
//     counted; the consumer waits for the database and tries again;
//   - the handler's, maybe transient (anything else): retried on [Retry]'s
//     schedule, then dead-lettered. Transaction conflicts ([IsConflict])
//     are retried without spending the budget.
//
// The eventline middleware gives each failure its verdict: a timeout or a
// lost connection under the handler is an outage only if the database does
// not answer a probe either; otherwise it was the handler's own.
//
// # Retries and dead letters: the safe chain in one call
//
// Outermost first, the only safe order is:
//
//	DeadLetter ▸ Retry ▸ eventline ▸ handler
//
// [Eventline.AddHandler] adds a handler to your Router with exactly that
// chain (and [Eventline.Chain] returns it as one middleware). [DeadLetter]
// holds what the chain gave up on in held_events (kind dead_letter), whole,
// in its own transaction, and never acknowledges a message without its
// row; [Eventline.RunSweeper] replays the dead letters an operator asked
// to replay (`eventline held replay`). [Retry] waits the documented
// schedule and waits out outages.
//
// Another order loses events: a poison queue inside the eventline
// middleware acknowledges a failed handler as a success, and a retry
// inside it runs the handler twice in one transaction. The middleware
// detects both (Watermill's PoisonQueue marks the message it dead-letters;
// a handler wrapped with [Innermost], as AddHandler does, counts its
// entries) and refuses the event with a *CompositionError: nothing is
// committed, the refusal is logged and counted, and Retry and DeadLetter
// hold the event until the chain is fixed. Do not add Watermill's
// PoisonQueue or Retry to a router running eventline handlers, and never
// use Watermill's Deduplicator middleware: it remembers a message before
// the handler runs and drops its redelivery after a failure. Never test
// ordering with gochannel, which reorders messages.
//
// # Parked events and the handler registry
//
// Events parked behind a missing version are applied later by the sweeper
// ([Eventline.RunSweeper] or [Eventline.Sweep]) through the handler they
// arrived on, with a savepoint of the sweeper's transaction in the context.
// The middleware finds that handler by Watermill handler name
// (message.HandlerNameFromCtx, recorded with the parked event):
//
//   - a handler is learned when it handles a message;
//   - [Eventline.Register] or [Eventline.MiddlewareFor] registers it up
//     front, which is needed to release events parked before a restart
//     when several handlers share the middleware;
//   - when a name is unknown and exactly one handler was wrapped, that one
//     is used.
//
// A parked event whose handler cannot be found, or whose handler fails,
// stays parked with the failure recorded; the sweeper retries it after an
// exponential backoff (Config.ReleaseBackoff), and gives it up after
// Config.MaxReleaseAttempts: its version is audited as skipped and
// Config.DeadLetter stores it (by default it is held as a late event).
//
// Late events (their version was given up on before they could be
// applied) are held for the operator, or, under versioning.ApplyLate,
// applied at once; a handler applying one sees [IsLate] report true.
//
// Messages a handler returns while a parked event is released by the
// sweeper cannot be published and are dropped with a warning; emit events
// from handlers with the producer's PublishTx through the transaction
// instead.
//
// # Effects outside the database
//
// [AfterCommit] runs a function after the consumer transaction commits:
// on arrival, in a drain, and in the sweeper alike, and never for a
// rolled-back savepoint. It is at most once: a crash between commit and
// hook loses it, and the redelivery is a duplicate. For an external effect
// that must happen, publish a follow-up event through the producer's outbox
// in the consumer transaction (producer.PublishTx with the tx from
// [TxFromContext]): it commits with the handler's writes and is delivered
// at least once (see Example_outboxFollowUp).
//
// # Payload upcasting
//
// Config.Upcasters brings each event's payload to the current schema
// version of its type (eventline.Upcasters) just before the handler runs,
// inside the composed middleware, so events released from parking and
// replayed dead letters pass through it too; parked and dead-lettered
// messages keep the payload as published:
//
//	el, err := middleware.New(middleware.Config{DB: pool, Group: "billing", Upcasters: up})
//	_, err = el.AddHandler(router, "billing", "orders", sub, onOrder)
//
// [Upcast] is the same step as a middleware, for handlers you wrap
// yourself; it must sit inside the eventline middleware.
//
// # Tracing
//
// With Config.TracerProvider set, each delivery gets a "process <topic>"
// span (kind consumer; [Eventline.Traced], which Chain and AddHandler put
// outermost) continuing the trace the record's headers carry, so one trace
// runs from the span PublishTx captured, through the relay's "send
// <topic>" span, to the handler, whose context carries the span: spans it
// starts nest under it. The span carries OpenTelemetry's messaging
// attributes (system, destination, message id, partition, offset,
// consumer group) and eventline's: event type, aggregate type, id and
// version, and eventline.outcome (applied, duplicate, stale, parked,
// skipped for a late event held, dead_lettered). A parked event applied
// later runs in a "release <topic>" span (outcome released) under the span
// of whatever released it (the event that filled the gap, or none in the
// sweeper), linked to the trace it arrived with; a dead letter is written
// in a "dead_letter <topic>" span. Each retry [Retry] schedules is an
// "eventline.retry" event on the process span, with the attempt that
// failed, the kind (handler, conflict, infrastructure,
// unsafe_composition), the wait and the error (cut to 1 KiB of valid
// UTF-8). Without a TracerProvider nothing is traced and Traced returns
// the handler itself. Stage latencies
// (relayed_to_applied, occurred_to_applied, parked_to_released) go to
// eventline_consumer_stage_seconds and, with Config.MeterProvider, to the
// OTel histogram eventline.stage.duration.
//
// # Metrics and logs
//
// [NewMetrics] creates Prometheus collectors (applied, duplicates, stale,
// parked, parked now, released, release failures, given up, late, late
// held now, late applied, gaps skipped, refused, handler latency,
// dead-lettered, retries, waits for the database and events waiting on it
// now, failed dead-letter writes and topic copies, replays, unsafe
// compositions); a nil *Metrics records nothing. The event_type label is
// bounded: registered types ([Metrics.RegisterEventTypes]) and the first
// MaxUnregisteredEventTypes others keep their name, the rest count as
// "other". Everything is logged through *slog.Logger.
package middleware
