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
//	  - dedup ([Dedup]) records the event id in processed_events; a duplicate
//	    is acknowledged without running the handler.
//	  - the version gate ([Gate]) locks the aggregate's version row and
//	    applies, discards (stale), parks or rejects the event (see package
//	    versioning), draining parked successors once the missing version is
//	    applied.
//
// In the composed middleware, dedup and the gate's lock, check and version
// advance are one SQL statement, sent in one batch with BEGIN
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
// # Retries and dead letters
//
// Mark errors that retrying cannot fix with [Permanent]; [IsPermanent] also
// recognises invalid events, unversioned events under RejectUnversioned and
// version conflicts. With Watermill's own middleware, the order that keeps
// these guarantees is, outermost first:
//
//	PoisonQueue ▸ Retry{ResetContextOnRetry: true, ShouldRetry: middleware.ShouldRetry} ▸ eventline ▸ handler
//
// PoisonQueue acknowledges what it dead-letters, so it must sit outside
// Retry; Retry must reset the context so every attempt starts a fresh
// transaction. Never use Watermill's Deduplicator middleware: it remembers
// a message before the handler runs and drops its redelivery after a
// failure. Never test ordering with gochannel, which reorders messages.
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
// A parked event whose handler cannot be found stays parked, with the
// failure recorded; the sweeper retries it on every pass.
//
// Messages a handler returns while a parked event is released by the
// sweeper cannot be published and are dropped with a warning; emit events
// from handlers with the producer's PublishTx through the transaction
// instead.
//
// # Payload upcasting
//
// [Upcast] brings each event's payload to the current schema version of
// its type (eventline.Upcasters) just before the handler runs. Put it
// inside the composed middleware (router.AddConsumerHandler(…).
// AddMiddleware(el.Middleware, middleware.Upcast(up))), so events released
// from parking pass through it too; parked and dead-lettered messages keep
// the payload as published.
//
// # Metrics and logs
//
// [NewMetrics] creates Prometheus collectors (applied, duplicates, stale,
// parked now, released, gaps skipped, handler latency, dead-lettered); a nil
// *Metrics records nothing. Everything is logged through *slog.Logger.
package middleware
