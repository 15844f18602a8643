package bench

import (
	"context"
	"fmt"
	"time"
)

// consumer_slow_handler: a handler that waits 5 ms per event (an external
// call) before its insert, on one partition with 100 aggregates.
const (
	slowDelay      = 5 * time.Millisecond
	slowAggregates = 100
	slowLanes      = 16
)

// runConsumerSlowHandler drains the same one-partition backlog with the
// ready runner on one lane and on slowLanes lanes (batches at their
// default both times), alternating.
func runConsumerSlowHandler(ctx context.Context, e *env) (Result, error) {
	n := e.sizes.SlowBacklog
	k, err := e.kafka()
	if err != nil {
		return Result{}, err
	}
	defer k.close()
	topic, err := k.topicN("slow", 1)
	if err != nil {
		return Result{}, err
	}
	if err := e.prefillConsumer(ctx, k, topic, n, slowAggregates); err != nil {
		return Result{}, err
	}
	type variant struct {
		lanes int
		sum   drainResult
	}
	variants := []*variant{{lanes: 1}, {lanes: slowLanes}}
	for round := 1; round <= e.sizes.ConsumerRounds; round++ {
		e.progressf("   round %d/%d", round, e.sizes.ConsumerRounds)
		for _, v := range alternate(variants, round-1) {
			d, err := e.consumeRunner(ctx, k, topic, n, runnerVariant{
				group: fmt.Sprintf("bench-slow%d-%d", v.lanes, round), schema: fmt.Sprintf("consumer_slow%d", v.lanes), lanes: v.lanes, slow: slowDelay, conns: slowLanes + 4,
				label: fmt.Sprintf("runner, %d lane(s)", v.lanes), profile: fmt.Sprintf("consumer_slow_handler.lanes_%d", v.lanes),
			})
			if err != nil {
				return Result{}, fmt.Errorf("%d lane(s): %w", v.lanes, err)
			}
			v.sum = v.sum.add(d)
		}
	}
	one, many := variants[0].sum, variants[1].sum
	res := Result{
		Rows: []Row{{
			Metric: fmt.Sprintf("consume events/s, %s handler, 1 partition, %d lanes", slowDelay, slowLanes),
			Ours:   many.rate(), Base: one.rate(), Baseline: "the same runner, 1 lane (one event or batch at a time per partition)", Target: "≥ 10.00 " + issue10,
		}},
		Notes: []string{fmt.Sprintf("%d events over %d aggregates, one partition, prefilled; the handler sleeps %s (an external call) then inserts, in the consumer transaction; batches at their default (%s); a pool of %d connections, all open before the runner starts; the rate runs from the %dth event committed (the first %d%% are the warm-up) to the last; %d round(s), the order reversed every other round",
			n, slowAggregates, slowDelay, "16", slowLanes+4, warmEvents(n), 100/warmShare, e.sizes.ConsumerRounds)},
	}
	res.Ratios = []Ratio{{Name: "consumer_slow_handler_lanes", Value: res.Rows[0].Ratio()}}
	return res, nil
}
