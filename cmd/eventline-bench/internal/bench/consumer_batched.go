package bench

import (
	"context"
	"fmt"
	"hash/fnv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/kafkaconf"
)

// consumeBareBatched is the batching consumer a team would write by hand,
// without dedup or version gate: a Sarama consumer group; each partition's
// records go to consumer.DefaultLanes lanes by a hash of the key; each lane
// takes what has queued up (up to consumer.DefaultBatchSize records),
// inserts them in one transaction, commits and marks the offsets. It is
// the baseline for "batches the same way without dedup or gate". (It marks
// offsets per lane, which a correct consumer must not do: one lane can mark
// past another lane's unfinished records. That only makes it faster.)
func (e *env) consumeBareBatched(ctx context.Context, k *kafkaEnv, topic string, n, round int) (drainResult, error) {
	schema, biz, drop, err := e.consumerSchema(ctx, "consumer_bare_batched", false)
	if err != nil {
		return drainResult{}, err
	}
	defer drop()
	pool, err := e.consumerPool(ctx)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	group := fmt.Sprintf("bench-bare-batched-%d", round)
	h := &bareBatchHandler{pool: pool, biz: biz, lanes: consumer.DefaultLanes, batch: consumer.DefaultBatchSize}
	cg, err := sarama.NewConsumerGroup(k.brokers, group, kafkaconf.Consumer("bench-"+group))
	if err != nil {
		return drainResult{}, err
	}
	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var c progressCounter
	h.done, h.first = &c.done, &c.first
	d, err := e.drainConsumer(ctx, "bare batching handler", "consumer_drain.bare_batched", n, &c, func() error {
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
	if err != nil {
		return d, err
	}
	return d, e.checkEffects(ctx, schema, n)
}

type bareBatchHandler struct {
	pool         *pgxpool.Pool
	biz          business
	lanes, batch int
	done, first  *atomic.Int64

	mu  sync.Mutex
	err error
}

func (h *bareBatchHandler) fail(err error) {
	h.mu.Lock()
	if h.err == nil {
		h.err = err
	}
	h.mu.Unlock()
}

func (h *bareBatchHandler) failed() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

func (*bareBatchHandler) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (*bareBatchHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

func (h *bareBatchHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	lanes := make([]chan *sarama.ConsumerMessage, h.lanes)
	var wg sync.WaitGroup
	for i := range lanes {
		lanes[i] = make(chan *sarama.ConsumerMessage, 256)
		wg.Add(1)
		go func() {
			defer wg.Done()
			h.lane(sess, lanes[i])
		}()
	}
	for km := range claim.Messages() {
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

// lane inserts what queued up, up to h.batch records, per transaction.
func (h *bareBatchHandler) lane(sess sarama.ConsumerGroupSession, in <-chan *sarama.ConsumerMessage) {
	ctx := context.Background()
	for km := range in {
		h.first.CompareAndSwap(0, time.Now().UnixNano())
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
			h.fail(err)
			continue
		}
		h.done.Add(int64(len(batch)))
		sess.MarkMessage(batch[len(batch)-1], "")
	}
}
