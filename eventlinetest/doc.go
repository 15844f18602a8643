// Package eventlinetest tests your eventline handlers against what the
// pipeline really does to events: it delivers them twice, out of order,
// after crashes and rebalances, and fails the handler's first attempt,
// and checks that the handler's effects are still those of applying each
// event once, in order.
//
// A handler is correct under eventline when everything it does goes
// through the consumer transaction: then a redelivery is skipped, an
// early version waits, and a failed attempt leaves nothing behind. Bugs
// slip in where that is not so (a counter bumped through a second pool,
// a read that does not see the transaction's own writes, a number drawn
// from other aggregates' events), and they only show under the faults
// the pipeline meets in production. Run puts the handler under those
// faults, in a test.
//
// # Testing a handler
//
// Give Run the handler, the tables it needs, the events and a query that
// reads its effects back:
//
//	func TestBilling(t *testing.T) {
//		eventlinetest.Run(t, eventlinetest.Case{
//			Setup: eventlinetest.SQL(`CREATE TABLE invoices (order_id text PRIMARY KEY, amount_cents bigint NOT NULL)`),
//			Handlers: map[string]consumer.HandlerFunc{
//				"order.created": eventlinetest.JSON(billing.OnOrderCreated), // as given to consumer.HandleJSON
//			},
//			Events: []eventline.Event{created("o-1", 1250), created("o-2", 990), cancelled("o-1")},
//			State:  eventlinetest.Rows(`SELECT order_id, amount_cents FROM invoices ORDER BY order_id`),
//		})
//	}
//
// Run first applies the events once, in the listed order, calling the
// handler directly in one transaction per event, and reads the reference
// state with State. Then it runs Case.Trials fault schedules (30 by
// default) through the real eventline middleware (middleware.New, the
// one consumer.New runs) and compares the state after each with the
// reference. The first schedules each test one fault class alone (see
// [Fault]: Duplicates, Reordering, Withholding, Crashes, Rebalances,
// HandlerErrors, Batches); the rest mix them at random, or use all of
// them at once. Each trial starts from the state right after Setup in one
// isolated schema (created, migrated with eventline's migrations and
// dropped by Run), whose connections have search_path set to it, so the
// handler's unqualified table names land there.
//
// When a schedule leaves different effects, or makes the handler fail
// where in-order application did not, Run looks for the smallest subset of
// its faults that still fails and fails the test with that subset, what
// happened delivery by delivery, both states and their difference, and
// the seed that replays the schedule:
//
//	eventlinetest: under a fault schedule, the handler's effects differ from applying each event once, in order
//	  replay: go test -run '^TestBilling$' -eventlinetest.seed=0xbef9147c35bd3e06   (or EVENTLINETEST_SEED=…, or Case.Seed)
//	  schedule: trial 6 of 30, testing handler errors; one partition, events in the order published
//	  smallest failing subset found (1 of 3):
//	    - the handler's first run for order/o-2 v1 (order.created) fails after it ran, and the event is retried
//	  deliveries:
//	    …
//	    3. deliver order/o-2 v1 (order.created) → instance 1: handler ran for v1 (then an injected failure); rolled back
//	    3. retry order/o-2 v1 (order.created) → instance 1: handler ran for v1; applied
//	  …
//	  difference (- only in order, + only after the schedule):
//	    - mails | o-2 | 1 | <nil>
//	    + mails | o-2 | 2 | <nil>
//
// A Watermill handler for your own Router goes in Case.Handler instead:
// the kit wraps it in the eventline middleware as your Router does, and it
// finds the transaction and the event with middleware.TxFromContext and
// middleware.EventFromContext. Case.Upcasters applies payload upcasting
// as middleware.Config.Upcasters (so consumer.Config.Upcasters) does.
//
// # What State should read
//
// Select what the handler decides (amounts, statuses, counts), ordered by
// a business key. Leave out what legitimately differs between correct
// runs: serial ids and sequences (a rolled-back attempt consumes values),
// timestamps, and anything that depends on the order of different
// aggregates, which nothing guarantees (if the handler itself depends on
// that order, the Reordering trials report it, rightly).
//
// # End to end
//
// With Case.Kafka set, each trial runs through Kafka instead, with
// consumer.New instances (see Case.Kafka): slower, so keep it for a few
// trials next to the direct ones.
package eventlinetest
