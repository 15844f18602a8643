package consumer

import (
	"hash/fnv"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline"
)

// laneKey is what keeps events in one lane: the aggregate
// (aggregate_type and aggregate_id), else the Kafka key, else nothing (all
// such events of a partition share one key, so they stay in order).
func laneKey(km *sarama.ConsumerMessage, msg *message.Message) string {
	if id := msg.Metadata.Get(eventline.MetaAggregateID); id != "" {
		return msg.Metadata.Get(eventline.MetaAggregateType) + "\x00" + id
	}
	return "\x01" + string(km.Key)
}

// laneAssigner spreads a partition's keys over its lanes. A key with
// events in a lane (queued or in flight) stays in that lane, so one
// aggregate's events are handled in offset order by one lane. A key with
// nothing in flight goes to the least loaded lane, starting the search at
// the lane its hash names, so an idle partition always uses the same lane
// for a key and a busy one balances its keys instead of letting a hash
// collision pile several hot aggregates on one lane while others idle.
//
// It is not safe for concurrent use.
type laneAssigner struct {
	load []int // events assigned to each lane and not finished
	keys map[string]*keyLane
}

type keyLane struct {
	lane, pending int
}

func newLaneAssigner(lanes int) *laneAssigner {
	return &laneAssigner{load: make([]int, lanes), keys: map[string]*keyLane{}}
}

// assign returns the lane for the next event of key.
func (a *laneAssigner) assign(key string) int {
	k := a.keys[key]
	if k == nil {
		k = &keyLane{lane: a.leastLoaded(key)}
		a.keys[key] = k
	}
	k.pending++
	a.load[k.lane]++
	return k.lane
}

// finish records that an event of key assigned to its lane is finished.
func (a *laneAssigner) finish(key string) {
	k := a.keys[key]
	if k == nil {
		return
	}
	a.load[k.lane]--
	if k.pending--; k.pending == 0 {
		delete(a.keys, key)
	}
}

func (a *laneAssigner) leastLoaded(key string) int {
	n := len(a.load)
	if n == 1 {
		return 0
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(key))
	start := int(h.Sum32() % uint32(n))
	best := start
	for i := 1; i < n; i++ {
		l := (start + i) % n
		if a.load[l] < a.load[best] {
			best = l
		}
	}
	return best
}
