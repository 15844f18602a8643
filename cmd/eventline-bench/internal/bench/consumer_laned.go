package bench

import (
	"context"
	"fmt"
	"hash/fnv"
	"sync"
	"sync/atomic"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
)

// consumeBareLaned is the consumer a team would write by hand with the
// runner's concurrency, without dedup or version gate: a Sarama consumer
// group; each partition's records go to consumer.DefaultLanes lanes by a
// hash of the key; each lane takes what has queued up (up to batch
// records; 1 applies one event per transaction), inserts them in one
// transaction and commits. Offsets follow the runner's rule: a partition's
// offset is marked only up to its lowest unfinished record, so a lane that
// runs ahead never commits past another lane's unfinished work.
func (e *env) consumeBareLaned(ctx context.Context, k *kafkaEnv, topic string, n, round, batch int) (drainResult, error) {
	prefix, label := "consumer_bare_laned", "bare handler, lanes, one event per tx"
	if batch > 1 {
		prefix, label = "consumer_bare_batched", "bare handler, lanes + batches"
	}
	schema, biz, drop, err := e.consumerSchema(ctx, prefix, false)
	if err != nil {
		return drainResult{}, err
	}
	defer drop()
	q := newQueryCounter()
	pool, err := e.consumerPool(ctx, q)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	group := fmt.Sprintf("bench-%s-%d", prefix, round)
	var c progressCounter
	h := &bareLanedHandler{pool: pool, biz: biz, lanes: consumer.DefaultLanes, batch: batch, done: &c.done}
	cg, err := sarama.NewConsumerGroup(k.brokers, group, consumerConfig("bench-"+group))
	if err != nil {
		return drainResult{}, err
	}
	m, err := e.startMeter(ctx, "consumer", label, []string{schema}, []*pgxpool.Pool{pool}, q)
	if err != nil {
		_ = cg.Close()
		return drainResult{}, err
	}
	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	d, err := e.drainConsumer(ctx, label, "consumer_drain."+prefix, n, &c, func() error {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for range cg.Errors() {
			}
		}()
		go func() {
			defer wg.Done()
			for cctx.Err() == nil {
				if err := cg.Consume(cctx, []string{topic}, h); err != nil && cctx.Err() == nil {
					h.fail(err)
					return
				}
			}
		}()
		return nil
	})
	cancel()
	if cerr := cg.Close(); err == nil {
		err = cerr
	}
	wg.Wait()
	if err == nil {
		err = h.failed()
	}
	if err == nil {
		err = e.stopCost(ctx, m, n, &d)
	}
	if err != nil {
		return d, err
	}
	return d, e.checkEffects(ctx, schema, n)
}

type bareLanedHandler struct {
	pool         *pgxpool.Pool
	biz          business
	lanes, batch int
	done         *atomic.Int64

	mu  sync.Mutex
	err error
}

func (h *bareLanedHandler) fail(err error) {
	h.mu.Lock()
	if h.err == nil {
		h.err = err
	}
	h.mu.Unlock()
}

func (h *bareLanedHandler) failed() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

func (*bareLanedHandler) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (*bareLanedHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

func (h *bareLanedHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	offsets := &offsetTracker{done: map[int64]bool{}}
	commit := func(finished []int64) {
		offsets.finish(finished, func(next int64) { sess.MarkOffset(claim.Topic(), claim.Partition(), next, "") })
	}
	lanes := make([]chan *sarama.ConsumerMessage, h.lanes)
	var wg sync.WaitGroup
	for i := range lanes {
		lanes[i] = make(chan *sarama.ConsumerMessage, 256)
		wg.Add(1)
		go func() {
			defer wg.Done()
			h.lane(lanes[i], commit)
		}()
	}
	for km := range claim.Messages() {
		offsets.add(km.Offset)
		hash := fnv.New32a()
		_, _ = hash.Write(km.Key)
		lanes[hash.Sum32()%uint32(h.lanes)] <- km
	}
	for _, l := range lanes {
		close(l)
	}
	wg.Wait()
	return nil
}

// lane inserts what queued up, up to h.batch records, per transaction,
// and reports the offsets it finished.
func (h *bareLanedHandler) lane(in <-chan *sarama.ConsumerMessage, commit func(finished []int64)) {
	ctx := context.Background()
	for km := range in {
		batch := []*sarama.ConsumerMessage{km}
	fill:
		for len(batch) < h.batch {
			select {
			case m, ok := <-in:
				if !ok {
					break fill
				}
				batch = append(batch, m)
			default:
				break fill
			}
		}
		err := pgx.BeginFunc(ctx, h.pool, func(tx pgx.Tx) error {
			for _, m := range batch {
				msg, err := kafka.DefaultMarshaler{}.Unmarshal(m)
				if err != nil {
					return err
				}
				ev, err := eventline.Decode(msg)
				if err != nil {
					return err
				}
				if err := h.biz.apply(ctx, tx, ev); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			h.fail(err) // the offsets stay unfinished: nothing past them is committed
			continue
		}
		h.done.Add(int64(len(batch)))
		finished := make([]int64, len(batch))
		for i, m := range batch {
			finished[i] = m.Offset
		}
		commit(finished)
	}
}

// offsetTracker is one partition's commit point under the runner's rule:
// records are handed out in offset order and finish in any order; the
// offset to commit is one past the highest offset below which every record
// finished.
type offsetTracker struct {
	mu      sync.Mutex
	pending []int64 // handed out, not yet below the commit point, ascending
	done    map[int64]bool
}

// add records an offset handed out (in ascending order).
func (t *offsetTracker) add(off int64) {
	t.mu.Lock()
	t.pending = append(t.pending, off)
	t.mu.Unlock()
}

// finish records finished offsets and, when the commit point moved, calls
// mark with the next offset to consume, under the tracker's lock so marks
// are made in order.
func (t *offsetTracker) finish(offs []int64, mark func(next int64)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, o := range offs {
		t.done[o] = true
	}
	next, moved := int64(0), false
	for len(t.pending) > 0 && t.done[t.pending[0]] {
		next, moved = t.pending[0]+1, true
		delete(t.done, t.pending[0])
		t.pending = t.pending[1:]
	}
	if moved {
		mark(next)
	}
}
