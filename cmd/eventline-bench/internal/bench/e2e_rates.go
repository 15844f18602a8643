package bench

import (
	"context"
	"sync"
	"time"
)

// rateResult is the latency at one offered rate, and whether the producers
// sustained that rate.
type rateResult struct {
	summary
	achieved  float64 // measured events committed per second
	sustained bool
	cpu       cpuUse // the machine's CPU use while the rate was offered
	cpuOK     bool
	// cpuPerEvent is the machine's CPU milliseconds per measured event.
	cpuPerEvent float64
	// proc and broker are the cores this process and the Kafka broker
	// (when its pid is known) used over the same window.
	proc, broker     float64
	procOK, brokerOK bool
	// costs are each stage's, then the whole pipeline's.
	costs []Cost
}

// rateSearch offers rates above the highest one whose p99 stayed within
// maxRateP99, each 25% above the last, until one does not (or maxRateCap),
// and returns the highest that did.
func (e *env) rateSearch(ctx context.Context, p *pipeline, label string, curve map[int]rateResult) (int, error) {
	best := 0
	for r, s := range curve {
		if s.p99 <= maxRateP99 && s.sustained && r > best {
			best = r
		}
	}
	if best == 0 {
		return 0, nil
	}
	limit := maxRateCap // below the lowest curve rate that failed, if any
	for r, s := range curve {
		if r > best && (s.p99 > maxRateP99 || !s.sustained) {
			limit = min(limit, r-1)
		}
	}
	for r := best * 5 / 4; r <= limit; r = r * 5 / 4 {
		s, err := e.offer(ctx, p, label+" (rate search)", r)
		if err != nil {
			return 0, err
		}
		if s.p99 > maxRateP99 || !s.sustained {
			break
		}
		best = r
	}
	return best, nil
}

// drain measures the pipeline's throughput on a backlog: drainEvents
// published as fast as the producers go, from the first commit to the last
// event applied.
func (e *env) drain(ctx context.Context, p *pipeline, label string) (float64, error) {
	n := e.drainEvents()

	jobs := make(chan struct{})
	var mu sync.Mutex
	var ids []string
	var wg sync.WaitGroup
	errc := make(chan error, 1)
	begin := time.Now()
	for range e.e2eWorkers() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range jobs {
				id, err := p.publish(ctx, p.prodPool)
				if err != nil {
					select {
					case errc <- err:
					default:
					}
					continue
				}
				mu.Lock()
				ids = append(ids, id)
				mu.Unlock()
			}
		}()
	}
	for range n {
		jobs <- struct{}{}
	}
	close(jobs)
	wg.Wait()
	select {
	case err := <-errc:
		return 0, err
	default:
	}
	count := func() int64 {
		var c int64
		p.tr.mu.Lock()
		defer p.tr.mu.Unlock()
		for _, id := range ids {
			if _, ok := p.tr.applied[id]; ok {
				c++
			}
		}
		return c
	}
	stop := e.watch(label+": drain", len(ids), count)
	end, err := waitFor(ctx, 5*time.Minute, int64(len(ids)), func() int64 { time.Sleep(20 * time.Millisecond); return count() })
	stop()
	if err != nil {
		return 0, err
	}
	rate := float64(len(ids)) / end.Sub(begin).Seconds()
	e.progressf("   %s: drained %d events at %.0f/s", label, len(ids), rate)
	return rate, nil
}

// drainEvents is how many events the drain publishes: drainEvents, half in
// the quick run, 200 with custom (test) sizes.
func (e *env) drainEvents() int {
	switch {
	case e.cfg.Sizes != nil:
		return 200
	case e.cfg.Quick:
		return drainEvents / 2
	}
	return drainEvents
}
