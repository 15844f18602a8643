package verify

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"golang.org/x/sync/errgroup"

	"github.com/eventline/eventline"
)

const (
	// maxReasonLength bounds a dead-letter reason kept in memory.
	maxReasonLength = 300
	// kafkaReaders bounds the partitions read at once.
	kafkaReaders = 8
)

// eventKey is a fixed-size digest of an event id, so a million records
// cost 32 bytes each in the index whatever the ids look like.
type eventKey [16]byte

func keyOf(eventID string) eventKey {
	sum := sha256.Sum256([]byte(eventID))
	var k eventKey
	copy(k[:], sum[:16])
	return k
}

// kafkaRecord is one event record on Kafka, as indexed.
type kafkaRecord struct {
	key       eventKey
	topic     uint16
	partition int32
	offset    int64
}

type topicPartition struct {
	topic     string
	partition int32
}

// topicState is what verify learned about one event topic; its
// summary's RetentionHorizon is nil when Kafka deleted nothing.
type topicState struct {
	summary TopicSummary
	unknown bool // missing, or compacted: absence proves nothing
}

// kafkaIndex is the event records of the topics read, sorted by event key.
type kafkaIndex struct {
	// topics are the topics read, kafkaRecord.topic indexing them.
	topics  []*topicState
	byName  map[string]uint16
	records []kafkaRecord
	// committed holds each group's committed offsets (the next offset it
	// will read) per topic and partition, fetched before the database
	// snapshot.
	committed map[string]map[topicPartition]int64
}

func newKafkaIndex() *kafkaIndex {
	return &kafkaIndex{byName: map[string]uint16{}, committed: map[string]map[topicPartition]int64{}}
}

// kafkaReader reads topics through one Sarama client.
type kafkaReader struct {
	cfg    Config
	client sarama.Client
	admin  sarama.ClusterAdmin
}

func newKafkaReader(cfg Config) (*kafkaReader, error) {
	client, err := sarama.NewClient(cfg.Brokers, cfg.SaramaConfig)
	if err != nil {
		return nil, fmt.Errorf("connect to Kafka at %s: %w; check the brokers, or run without them to skip the Kafka check", strings.Join(cfg.Brokers, ","), err)
	}
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("open a Kafka admin client: %w", err)
	}
	return &kafkaReader{cfg: cfg, client: client, admin: admin}, nil
}

// close closes the admin client, which closes the client too.
func (k *kafkaReader) close() { _ = k.admin.Close() }

// groupOffsets returns the committed offsets of Kafka consumer groups named
// like the eventline groups. A group Kafka does not know has none.
func (k *kafkaReader) groupOffsets(groups []string) (map[string]map[topicPartition]int64, error) {
	out := map[string]map[topicPartition]int64{}
	for _, g := range groups {
		resp, err := k.admin.ListConsumerGroupOffsets(g, nil)
		if errors.Is(err, sarama.ErrGroupIDNotFound) {
			k.cfg.Logger.Debug("eventline verify: Kafka has no consumer group named like the eventline group", "group", g)
			out[g] = map[topicPartition]int64{}
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read the committed offsets of Kafka consumer group %q: %w", g, err)
		}
		m := map[topicPartition]int64{}
		for topic, parts := range resp.Blocks {
			for p, b := range parts {
				if b != nil && b.Err == sarama.ErrNoError && b.Offset >= 0 {
					m[topicPartition{topic, p}] = b.Offset
				}
			}
		}
		out[g] = m
	}
	return out, nil
}

// compacted reports whether the topic's cleanup.policy includes compact.
func (k *kafkaReader) compacted(topic string) (bool, error) {
	entries, err := k.admin.DescribeConfig(sarama.ConfigResource{Type: sarama.TopicResource, Name: topic, ConfigNames: []string{"cleanup.policy"}})
	if err != nil {
		return false, err
	}
	for _, e := range entries {
		if e.Name == "cleanup.policy" {
			return strings.Contains(e.Value, "compact"), nil
		}
	}
	return false, nil
}

// partitionBounds is a partition's log start and high watermark.
type partitionBounds struct {
	partition   int32
	start, high int64
}

// bounds returns the partitions of topic with their log start offsets and
// high watermarks, as of now: none when Kafka does not know the topic.
func (k *kafkaReader) bounds(topic string) ([]partitionBounds, error) {
	err := k.client.RefreshMetadata(topic)
	var parts []int32
	if err == nil {
		parts, err = k.client.Partitions(topic)
	}
	if errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read Kafka metadata of topic %s: %w", topic, err)
	}
	out := make([]partitionBounds, 0, len(parts))
	for _, p := range parts {
		start, err := k.client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, fmt.Errorf("read the log start of %s/%d: %w", topic, p, err)
		}
		high, err := k.client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, fmt.Errorf("read the high watermark of %s/%d: %w", topic, p, err)
		}
		out = append(out, partitionBounds{partition: p, start: start, high: high})
	}
	return out, nil
}

// readPartition reads [start, high) of one partition and calls fn for each
// record. It stops early when the partition delivers nothing for the idle
// timeout.
func (k *kafkaReader) readPartition(ctx context.Context, consumer sarama.Consumer, topic string, b partitionBounds,
	fn func(*sarama.ConsumerMessage)) (first time.Time, lastRead int64, err error) {
	lastRead = -1
	if b.high <= b.start {
		return first, lastRead, nil
	}
	pc, err := consumer.ConsumePartition(topic, b.partition, b.start)
	if err != nil {
		return first, lastRead, fmt.Errorf("read Kafka partition %s/%d: %w", topic, b.partition, err)
	}
	defer pc.AsyncClose()
	idle := time.NewTimer(kafkaIdleTimeout)
	defer idle.Stop()
	for {
		select {
		case <-ctx.Done():
			return first, lastRead, ctx.Err()
		case perr := <-pc.Errors():
			if perr != nil {
				return first, lastRead, fmt.Errorf("read Kafka partition %s/%d: %w", topic, b.partition, perr.Err)
			}
		case <-idle.C:
			k.cfg.Logger.Warn("eventline verify: Kafka partition went idle before the high watermark",
				"topic", topic, "partition", b.partition, "last_offset", lastRead, "high_watermark", b.high)
			return first, lastRead, nil
		case m, ok := <-pc.Messages():
			if !ok {
				return first, lastRead, nil
			}
			if m.Offset >= b.high {
				return first, lastRead, nil
			}
			if lastRead < 0 {
				first = m.Timestamp
			}
			lastRead = m.Offset
			fn(m)
			if m.Offset >= b.high-1 {
				return first, lastRead, nil
			}
			idle.Reset(kafkaIdleTimeout) // Go 1.23+ timers: no stale fire after Reset
		}
	}
}

// read reads every partition of the given event topics up to the high
// watermark taken now, and builds the index.
func (k *kafkaReader) read(ctx context.Context, idx *kafkaIndex, eventTopics []string) error {
	consumer, err := sarama.NewConsumerFromClient(k.client)
	if err != nil {
		return fmt.Errorf("open a Kafka consumer: %w", err)
	}
	defer consumer.Close()

	type job struct {
		topic string
		ti    uint16
		b     partitionBounds
		st    *topicState
	}
	var jobs []job
	for _, t := range eventTopics {
		st := &topicState{summary: TopicSummary{Topic: t}}
		ti := uint16(len(idx.topics))
		idx.topics = append(idx.topics, st)
		idx.byName[t] = ti
		parts, err := k.bounds(t)
		if err != nil {
			return err
		}
		if len(parts) == 0 {
			st.summary.Missing, st.unknown = true, true
			continue
		}
		compacted, err := k.compacted(t)
		if err != nil {
			k.cfg.Logger.Warn("eventline verify: cannot read the topic's cleanup.policy; absence from it will prove nothing", "topic", t, "err", err)
			st.unknown = true
		}
		st.summary.Compacted = compacted
		st.unknown = st.unknown || compacted
		st.summary.Partitions = len(parts)
		for _, b := range parts {
			jobs = append(jobs, job{topic: t, ti: ti, b: b, st: st})
		}
	}
	var mu sync.Mutex
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(kafkaReaders)
	for _, j := range jobs {
		g.Go(func() error {
			var recs []kafkaRecord
			var n int64
			first, last, err := k.readPartition(gctx, consumer, j.topic, j.b, func(m *sarama.ConsumerMessage) {
				n++
				if id := RecordEventID(m); id != "" {
					recs = append(recs, kafkaRecord{key: keyOf(id), topic: j.ti, partition: m.Partition, offset: m.Offset})
				}
			})
			if err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			j.st.summary.Records += n
			if rh := j.st.summary.RetentionHorizon; j.b.start > 0 && last >= 0 && (rh == nil || first.After(*rh)) {
				j.st.summary.RetentionHorizon = &first
			}
			if j.b.start > 0 && last < 0 {
				// Everything Kafka kept was deleted: nothing here can be
				// told apart from a deleted record.
				j.st.unknown = true
			}
			idx.records = append(idx.records, recs...)
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	slices.SortFunc(idx.records, func(a, b kafkaRecord) int {
		return cmp.Or(bytes.Compare(a.key[:], b.key[:]), cmp.Compare(a.topic, b.topic),
			cmp.Compare(a.partition, b.partition), cmp.Compare(a.offset, b.offset))
	})
	for i := 1; i < len(idx.records); i++ {
		a, b := idx.records[i-1], idx.records[i]
		if a.key == b.key && a.topic == b.topic {
			idx.topics[b.topic].summary.Duplicates++
		}
	}
	return nil
}

// RecordEventID returns a record's event id: the event_id header, else the
// Watermill message UUID header.
func RecordEventID(m *sarama.ConsumerMessage) string {
	var uuid string
	for _, h := range m.Headers {
		switch string(h.Key) {
		case eventline.MetaEventID:
			return string(h.Value)
		case kafka.UUIDHeaderKey:
			uuid = string(h.Value)
		}
	}
	return uuid
}

// kafkaLookup is where an event was found on Kafka.
type kafkaLookup struct {
	// copies are the event's records on its topic.
	copies []kafkaRecord
	// absent is true when the event is not on the topic and that proves it
	// was never published there: nothing was deleted from the topic since
	// the event was committed, and the topic is not compacted.
	absent bool
	// deleted is true when the event is not on the topic and Kafka's
	// retention may have deleted it.
	deleted bool
}

// lookup finds an event's records on its topic. createdAt is when the
// event was committed.
func (idx *kafkaIndex) lookup(eventID, topic string, createdAt time.Time) kafkaLookup {
	ti, ok := idx.byName[topic]
	if !ok {
		return kafkaLookup{}
	}
	st := idx.topics[ti]
	k := keyOf(eventID)
	i, _ := slices.BinarySearchFunc(idx.records, k, func(r kafkaRecord, k eventKey) int { return bytes.Compare(r.key[:], k[:]) })
	var l kafkaLookup
	for ; i < len(idx.records) && idx.records[i].key == k; i++ {
		if idx.records[i].topic == ti {
			l.copies = append(l.copies, idx.records[i])
		}
	}
	if len(l.copies) > 0 || st.unknown {
		return l
	}
	if rh := st.summary.RetentionHorizon; rh != nil && createdAt.Before(rh.Add(clockSkew)) {
		l.deleted = true
	} else {
		l.absent = true
	}
	return l
}

// consumedBy returns a copy of the event the group's committed Kafka offset
// has moved past, if any.
func (idx *kafkaIndex) consumedBy(group string, l kafkaLookup) (kafkaRecord, int64, bool) {
	offsets := idx.committed[group]
	for _, r := range l.copies {
		if c, ok := offsets[topicPartition{idx.topics[r.topic].summary.Topic, r.partition}]; ok && c > r.offset {
			return r, c, true
		}
	}
	return kafkaRecord{}, 0, false
}
