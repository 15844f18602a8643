package producer

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/outbox"
)

const (
	// hotPollInterval is how often the relay looks, in one query, at the
	// shards that found no rows a moment ago: while the outbox is busy a
	// shard's next rows are usually a few milliseconds away, and asking
	// producers to notify (outbox_waiting) would make them serialize their
	// commits on PostgreSQL's notification lock.
	hotPollInterval = 2 * time.Millisecond
	// hotWindow is how long a shard keeps being polled after it last
	// relayed rows, before it asks for notifications instead.
	hotWindow = 500 * time.Millisecond
	// busyWindow is how long a shard that relayed rows stays in the poll
	// statement although it is not lingering. Under steady load every
	// shard relays within it, so the statement's shard list, and with it
	// its text, stays the same from one poll to the next: PostgreSQL keeps
	// one prepared statement per connection and runs its generic plan
	// instead of planning each poll again (with the list of the shards
	// lingering at that instant, 85% of polls were planned).
	busyWindow = 2 * time.Second
	// maxHotPollInterval is the longest interval between polls while
	// shards linger: at low rates the poller polls about once per event
	// relayed (rateInterval), never less often than this, so a row is
	// noticed as soon as plain Watermill polling every 10 ms would.
	maxHotPollInterval = 10 * time.Millisecond
	// rateWindow is the time constant of the relay's rate estimate
	// (poller.rows), which sets the poll interval.
	rateWindow = time.Second
	// stallFastPhase is how long the poller keeps polling at its usual
	// interval while every polled shard is held back by the xmin
	// horizon; after it, it backs off (pollBackoff).
	stallFastPhase = 2 * time.Second
	// stallWarnAfter is how long a stall lasts before the relay warns and
	// names the transaction holding the horizon.
	stallWarnAfter = 10 * time.Second
)

// pollBackoff is the poller's interval while every polled shard has been
// held back by the xmin horizon for longer than stallFastPhase, or its poll
// failed: hotPollInterval, doubling, at most 20ms.
var pollBackoff = eventline.Backoff{Initial: hotPollInterval, Multiplier: 2, Max: 20 * time.Millisecond}

// poller looks at the shards that are waiting for rows with one query per
// interval, and wakes those that have rows they can read. A shard is
// "stalled" when it has committed rows it cannot read yet because an older
// transaction is still open (the xmin horizon); the poller keeps looking,
// so such rows are read as soon as the horizon passes, which nothing would
// notify.
type poller struct {
	r      *Relay
	mu     sync.Mutex
	set    map[int]*shardRunner
	recent map[int]time.Time // when each shard last relayed rows
	kick   chan struct{}
	sql    map[string]string // poll statement by shard list
	polls  atomic.Int64      // polls run, for tests
	// rows counts the rows the relay's shards read, decaying with time
	// constant rateWindow since rowsAt: rows/rateWindow estimates the
	// relay's rate.
	rows   float64
	rowsAt time.Time
}

func newPoller(r *Relay) *poller {
	return &poller{r: r, set: map[int]*shardRunner{}, recent: map[int]time.Time{}, kick: make(chan struct{}, 1), sql: map[string]string{}}
}

// relayed records that shard just relayed rows rows: it stays in the poll
// statement for busyWindow, and the rows count towards the relay's rate.
func (p *poller) relayed(shard, rows int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	p.recent[shard] = now
	p.decay(now)
	p.rows += float64(rows)
}

// decay brings the rows count to now; p.mu is held.
func (p *poller) decay(now time.Time) {
	if !p.rowsAt.IsZero() {
		p.rows *= math.Exp(-float64(now.Sub(p.rowsAt)) / float64(rateWindow))
	}
	p.rowsAt = now
}

// rateInterval is the poll interval at the relay's current rate: about
// one poll per row relayed, between hotPollInterval and
// maxHotPollInterval, since a poll costs the same whether it finds rows or
// not (docs/DESIGN.md, "Waiting for rows").
func (p *poller) rateInterval() time.Duration {
	p.mu.Lock()
	p.decay(time.Now())
	rate := p.rows / rateWindow.Seconds()
	p.mu.Unlock()
	if rate*maxHotPollInterval.Seconds() <= 1 {
		return maxHotPollInterval
	}
	return max(time.Duration(float64(time.Second)/rate), hotPollInterval)
}

func (p *poller) watch(s *shardRunner) {
	p.mu.Lock()
	p.set[s.shard] = s
	p.mu.Unlock()
	signal(p.kick)
}

func (p *poller) unwatch(s *shardRunner) {
	p.mu.Lock()
	if p.set[s.shard] == s {
		delete(p.set, s.shard)
	}
	p.mu.Unlock()
}

func (p *poller) watched() []*shardRunner {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]*shardRunner, 0, len(p.set))
	for _, s := range p.set {
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b *shardRunner) int { return a.shard - b.shard })
	return out
}

// busy returns, in order, the shards a poll looks at: the lingering ones
// (shards) and those that relayed rows in the last busyWindow.
func (p *poller) busy(shards []*shardRunner) []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	out := make([]int, 0, len(shards)+len(p.recent))
	for shard, at := range p.recent {
		if now.Sub(at) > busyWindow {
			delete(p.recent, shard)
			continue
		}
		out = append(out, shard)
	}
	for _, s := range shards {
		out = append(out, s.shard)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

func (p *poller) run(ctx context.Context) {
	slow := 0 // polls in a row that failed or found every shard stalled
	t := time.NewTimer(hotPollInterval)
	defer t.Stop()
	for {
		shards := p.watched()
		if len(shards) == 0 {
			select {
			case <-ctx.Done():
				return
			case <-p.kick:
				slow = 0
				continue
			}
		}
		t.Reset(max(backoff.Delay(pollBackoff, slow+1), p.rateInterval()))
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		shards = p.watched()
		if len(shards) == 0 {
			continue
		}
		ready, err := p.poll(ctx, shards)
		p.polls.Add(1)
		slow++ // unless the poll finds a shard not stalled (for long)
		if err != nil {
			if ctx.Err() == nil {
				p.r.log.Debug("poll outbox shards", "err", err)
			}
			continue
		}
		for i, s := range shards {
			switch ready[i] {
			case pollReadable:
				p.unwatch(s)
				s.unstall()
				s.notify()
				slow = 0
			case pollHeldBack:
				if s.stall() < stallFastPhase {
					slow = 0
				}
			default:
				s.unstall()
				slow = 0
			}
		}
	}
}

// pollShardSQL says whether the row after a shard's position ($1 the
// relays' consumer group) can be read, NULL when there is none. LATERAL
// makes the position a parameter of the index scan: a plain join would
// filter every row from the start.
const pollShardSQL = `(SELECT x.readable FROM {offsets} o CROSS JOIN LATERAL (
	SELECT m.transaction_id < pg_snapshot_xmin(pg_current_snapshot()) AS readable FROM {messages} m
	WHERE (m.transaction_id, m."offset") > (o.last_processed_transaction_id, o.offset_acked)
	ORDER BY m.transaction_id, m."offset" LIMIT 1) x
	WHERE o.consumer_group = $1)`

type pollResult int

const (
	pollEmpty    pollResult = iota // no row past the position
	pollReadable                   // the next row can be read
	pollHeldBack                   // the next row waits behind the xmin horizon
)

// poll reports, for each shard, whether the row after its position exists
// and can be read: one index probe per shard, in one statement. The
// statement covers every busy shard, not only these (see busyWindow).
func (p *poller) poll(ctx context.Context, shards []*shardRunner) ([]pollResult, error) {
	busy := p.busy(shards)
	key := fmt.Sprint(busy)
	q, ok := p.sql[key]
	if !ok {
		parts := make([]string, len(busy))
		for i, shard := range busy {
			parts[i] = outbox.SQL(p.r.cfg.Schema, shard, pollShardSQL)
		}
		q = `SELECT ARRAY[` + strings.Join(parts, ", ") + `]::bool[]`
		if len(p.sql) > 256 {
			clear(p.sql)
		}
		p.sql[key] = q
	}
	qctx, cancel := context.WithTimeout(ctx, statementTimeout)
	defer cancel()
	var res []*bool
	if err := p.r.pool.QueryRow(qctx, q, outbox.RelayConsumerGroup).Scan(&res); err != nil {
		return nil, err
	}
	out := make([]pollResult, len(shards))
	for i, s := range shards {
		j, _ := slices.BinarySearch(busy, s.shard)
		switch {
		case j >= len(res) || res[j] == nil:
			out[i] = pollEmpty
		case *res[j]:
			out[i] = pollReadable
		default:
			out[i] = pollHeldBack
		}
	}
	return out, nil
}
