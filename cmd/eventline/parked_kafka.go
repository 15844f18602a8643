package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/IBM/sarama"

	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/internal/verify"
)

// whereKafka: the relayed version was found on Kafka (with -brokers).
const whereKafka = "kafka"

// kafkaWhere is where a relayed version's record is on Kafka.
type kafkaWhere struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	Offset    int64  `json:"offset"`
	// GroupCommitted is the group's committed offset in that partition;
	// null when the group has committed none.
	GroupCommitted *int64 `json:"group_committed_offset"`
}

// kafkaScanLimit bounds the records read per partition when looking for
// one event, from the first record of its commit time on.
const kafkaScanLimit = 100_000

// kafkaScanWait bounds the wait for the next record of a partition.
const kafkaScanWait = 10 * time.Second

// kafkaSkew is how far before its outbox commit time an event's record
// is looked for (clock differences between database and relay).
const kafkaSkew = time.Minute

// locateOnKafka looks up, for the versions the relay published, their
// record on Kafka and the group's committed offset there, and rewrites
// their entry in where.
func locateOnKafka(ctx context.Context, brokers []string, where map[store.Key]versionWhere) error {
	var keys []store.Key
	for k, w := range where {
		if w.Location == whereRelayed && w.eventID != "" && w.topic != "" {
			keys = append(keys, k)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	cfg := kafkaconf.Consumer("eventline-parked-list")
	client, err := sarama.NewClient(brokers, cfg)
	if err != nil {
		return fmt.Errorf("connect to Kafka at %s: %w; check -brokers, or leave it out to skip the Kafka lookup", strings.Join(brokers, ","), err)
	}
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		_ = client.Close()
		return fmt.Errorf("open a Kafka admin client: %w", err)
	}
	defer admin.Close() // closes the client too
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return fmt.Errorf("open a Kafka consumer: %w", err)
	}
	defer consumer.Close()
	for _, k := range keys {
		w := where[k]
		part, offset, found, err := findRecord(ctx, client, consumer, w.topic, w.eventID, w.committed.Add(-kafkaSkew))
		if err != nil {
			return err
		}
		if !found {
			w.Detail = fmt.Sprintf("relayed to Kafka topic %q (committed %s ago), but not found there from its commit time on (read up to %d records a partition): deleted by retention, or published to another cluster?",
				w.topic, age(time.Since(w.committed)), kafkaScanLimit)
			where[k] = w
			continue
		}
		kw := &kafkaWhere{Topic: w.topic, Partition: part, Offset: offset}
		// The Kafka consumer group is named like the eventline group; one
		// Kafka does not know has committed nothing.
		resp, err := admin.ListConsumerGroupOffsets(k.Group, map[string][]int32{w.topic: {part}})
		switch {
		case errors.Is(err, sarama.ErrGroupIDNotFound):
		case err != nil:
			return fmt.Errorf("read the committed offsets of Kafka consumer group %s: %w", k.Group, err)
		default:
			if b := resp.GetBlock(w.topic, part); b != nil && b.Err == sarama.ErrNoError && b.Offset >= 0 {
				c := b.Offset
				kw.GroupCommitted = &c
			}
		}
		w.Location, w.Kafka = whereKafka, kw
		switch c := kw.GroupCommitted; {
		case c != nil && *c > offset:
			w.Detail = fmt.Sprintf("on Kafka at %s/%d offset %d; the group's committed offset there is %d, past it, yet it was not applied: it may be lost (eventline verify), or dead-lettered to a topic", w.topic, part, offset, *c)
		case c != nil:
			w.Detail = fmt.Sprintf("on Kafka at %s/%d offset %d; the group's committed offset there is %d: it has not consumed it yet (is it running? lagging?)", w.topic, part, offset, *c)
		default:
			w.Detail = fmt.Sprintf("on Kafka at %s/%d offset %d; the group has committed no offset there: is it consuming %s?", w.topic, part, offset, w.topic)
		}
		where[k] = w
	}
	return nil
}

// findRecord reads topic's partitions from the first record at or after
// since, looking for the record of eventID.
func findRecord(ctx context.Context, client sarama.Client, consumer sarama.Consumer, topic, eventID string, since time.Time) (int32, int64, bool, error) {
	parts, err := client.Partitions(topic)
	if err != nil {
		return 0, 0, false, fmt.Errorf("read the partitions of Kafka topic %s: %w", topic, err)
	}
	for _, p := range parts {
		start, err := client.GetOffset(topic, p, since.UnixMilli())
		if err != nil {
			return 0, 0, false, fmt.Errorf("find the offset of %s in Kafka topic %s/%d: %w", since.Format(time.RFC3339), topic, p, err)
		}
		high, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, 0, false, fmt.Errorf("read the high watermark of Kafka topic %s/%d: %w", topic, p, err)
		}
		if start < 0 || start >= high {
			continue
		}
		off, found, err := scanPartition(ctx, consumer, topic, p, start, min(high, start+kafkaScanLimit), eventID)
		if err != nil || found {
			return p, off, found, err
		}
	}
	return 0, 0, false, nil
}

// scanPartition reads offsets start..end-1 of one partition for eventID.
func scanPartition(ctx context.Context, consumer sarama.Consumer, topic string, p int32, start, end int64, eventID string) (int64, bool, error) {
	pc, err := consumer.ConsumePartition(topic, p, start)
	if err != nil {
		return 0, false, fmt.Errorf("read Kafka topic %s/%d: %w", topic, p, err)
	}
	defer pc.Close()
	timer := time.NewTimer(kafkaScanWait)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return 0, false, ctx.Err()
		case <-timer.C:
			return 0, false, fmt.Errorf("read Kafka topic %s/%d: no record for %s", topic, p, kafkaScanWait)
		case kerr := <-pc.Errors():
			return 0, false, fmt.Errorf("read Kafka topic %s/%d: %w", topic, p, kerr)
		case m := <-pc.Messages():
			if verify.RecordEventID(m) == eventID {
				return m.Offset, true, nil
			}
			if m.Offset+1 >= end {
				return 0, false, nil
			}
			timer.Reset(kafkaScanWait)
		}
	}
}
