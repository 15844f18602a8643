package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/admin/verify"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/producer"
)

// Where a missing version is, as `parked list` reports it (the location
// field of waiting_for in -json).
const (
	// whereConsumerDeadLetter: the group dead-lettered it
	// (eventline held list -kind dead_letter).
	whereConsumerDeadLetter = "consumer_dead_letter"
	// whereRelayDeadLetter: the relay gave up publishing it
	// (eventline held list -kind relay_dead_letter).
	whereRelayDeadLetter = "relay_dead_letter"
	// whereOutboxPending: committed in the outbox, not yet relayed.
	whereOutboxPending = "outbox_pending"
	// whereRelayed: the relay published it to Kafka; the group has not
	// applied it.
	whereRelayed = "relayed"
	// whereKafka: relayed, and found on Kafka (with -brokers).
	whereKafka = "kafka"
	// whereNowhere: in neither the outbox nor a dead-letter table.
	whereNowhere = "nowhere"
	// whereUnknown: the outbox could not be searched.
	whereUnknown = "unknown"
)

// versionWhere says where a parked aggregate's next missing version is.
type versionWhere struct {
	Version  int64  `json:"version"`
	Location string `json:"location"`
	Detail   string `json:"detail"`
	// Kafka is where the record is on Kafka (relayed versions, when
	// -brokers is given).
	Kafka *kafkaWhere `json:"kafka,omitempty"`

	// eventID, topic and committed describe a relayed version's outbox
	// row, for the Kafka lookup.
	eventID, topic string
	committed      time.Time
}

// aggVersion names one version of one aggregate.
type aggVersion struct {
	typ, id string
	version int64
}

// outboxTarget is where the outbox is searched.
type outboxTarget struct {
	db     store.DBTX
	schema string
}

// whereMissing finds where the next missing version of each of aggs is:
// in the consumer's database (pool, -schema), the outbox at outboxURL
// (default: the same database) in outboxSchema (default -schema), and, with
// -brokers, on Kafka.
func (inv *invocation) whereMissing(ctx context.Context, pool *pgxpool.Pool, aggs []parkedAggregate, outboxURL, outboxSchema string) (map[store.Key]versionWhere, error) {
	want := map[store.Key]int64{}
	for _, a := range aggs {
		if a.follows > a.current {
			want[a.key] = a.current + 1
		}
	}
	schema := inv.globals.schema
	ob := outboxTarget{db: pool, schema: cmp.Or(outboxSchema, schema)}
	if outboxURL != "" && len(want) > 0 {
		db := database{url: outboxURL, what: "the outbox database", flag: "-outbox-database-url"}
		opool, err := inv.openPool(ctx, db, 2)
		if err != nil {
			return nil, err
		}
		ob.db = opool
	}
	where, err := locateMissing(ctx, pool, schema, ob, want)
	if err != nil {
		return nil, err
	}
	if brokers := kafkaconf.ParseBrokers(inv.globals.brokers); len(brokers) > 0 {
		err = locateOnKafka(ctx, brokers, where)
	}
	return where, err
}

// locateMissing finds, for each key's next missing version, where it is:
// the group's consumer dead letters (in consumerDB, consumerSchema), then
// the outbox's relay dead letters and shard tables. The outbox is searched
// with one query per shard that holds a wanted aggregate.
func locateMissing(ctx context.Context, consumerDB store.DBTX, consumerSchema string, ob outboxTarget, want map[store.Key]int64) (map[store.Key]versionWhere, error) {
	out := map[store.Key]versionWhere{}
	if len(want) == 0 {
		return out, nil
	}
	// The groups' dead letters of the missing versions, the newest of each.
	for k, v := range want {
		list, err := admin.ListHeld(ctx, consumerDB, consumerSchema, admin.HeldFilter{Kind: admin.HeldDeadLetter, Group: k.Group,
			AggregateType: k.AggregateType, AggregateID: k.AggregateID, Limit: 10_000})
		if err != nil {
			return nil, fmt.Errorf("read consumer dead letters: %w", err)
		}
		for _, d := range list {
			if d.AggregateVersion == v {
				out[k] = versionWhere{Version: v, Location: whereConsumerDeadLetter,
					Detail: fmt.Sprintf("dead-lettered by the group (%s, held event %d): eventline held list -group %s", d.Cause, d.ID, k.Group)}
			}
		}
	}
	wanted := map[aggVersion][]store.Key{}
	for k, v := range want {
		if _, done := out[k]; !done {
			av := aggVersion{k.AggregateType, k.AggregateID, v}
			wanted[av] = append(wanted[av], k)
		}
	}
	if len(wanted) == 0 {
		return out, nil
	}
	found, err := searchOutbox(ctx, ob, wanted)
	if err != nil {
		for av, keys := range wanted {
			for _, k := range keys {
				out[k] = versionWhere{Version: av.version, Location: whereUnknown, Detail: err.Error()}
			}
		}
		return out, nil
	}
	for av, keys := range wanted {
		w, ok := found[av]
		if !ok {
			w = versionWhere{Version: av.version, Location: whereNowhere,
				Detail: fmt.Sprintf("not in the outbox (schema %s) nor dead-lettered: never published there, or its row was cleaned up; if it will never come: eventline parked release", ob.schema)}
		}
		for _, k := range keys {
			out[k] = w
		}
	}
	return out, nil
}

// searchOutbox looks the versions up in the relay's dead letters and the
// outbox shards. An error means the outbox could not be searched.
func searchOutbox(ctx context.Context, ob outboxTarget, wanted map[aggVersion][]store.Key) (map[aggVersion]versionWhere, error) {
	versions := make([]admin.AggregateVersion, 0, len(wanted))
	for av := range wanted {
		versions = append(versions, admin.AggregateVersion{AggregateType: av.typ, AggregateID: av.id, Version: av.version})
	}
	// The newest outbox row of each version: relayed when the relay's
	// position is at or past it, dead when the relay holds it.
	rows, err := admin.FindOutboxVersions(ctx, ob.db, ob.schema, versions)
	if errors.Is(err, producer.ErrNotMigrated) {
		return nil, fmt.Errorf("no outbox in schema %s: if it lives elsewhere, pass -outbox-database-url and -outbox-schema", ob.schema)
	}
	if err != nil {
		return nil, err
	}
	dead, err := relayDeadLetters(ctx, ob, wanted)
	if err != nil {
		return nil, err
	}
	found := map[aggVersion]versionWhere{}
	for _, r := range rows {
		av := aggVersion{r.AggregateType, r.AggregateID, r.Version}
		w := versionWhere{Version: av.version, eventID: r.EventID, topic: r.Topic, committed: r.Committed}
		since := age(time.Since(r.Committed))
		d, isDead := dead[av]
		switch {
		case isDead && d.Shard == r.Shard && d.MessageUUID == r.MessageUUID:
			w.Location, w.Detail = whereRelayDeadLetter, fmt.Sprintf("the relay dead-lettered it (held event %d): eventline held list -kind relay_dead_letter", d.ID)
		case r.Relayed:
			w.Location, w.Detail = whereRelayed, fmt.Sprintf("relayed to Kafka topic %q (committed %s ago, shard %d); the group has not applied it: is it consuming that topic? (eventline verify reads it)", r.Topic, since, r.Shard)
		default:
			w.Location, w.Detail = whereOutboxPending, fmt.Sprintf("in the outbox, not relayed yet (committed %s ago, shard %d): see eventline status", since, r.Shard)
		}
		found[av] = w
	}
	// Dead letters whose outbox row is gone (cleaned up).
	for av, d := range dead {
		if _, ok := found[av]; !ok {
			found[av] = versionWhere{Version: av.version, Location: whereRelayDeadLetter,
				Detail: fmt.Sprintf("the relay dead-lettered it (held event %d): eventline held list -kind relay_dead_letter", d.ID)}
		}
	}
	return found, nil
}

// relayDeadLetters returns the relay's dead letters waiting for an
// operator among the wanted versions, the newest of each.
func relayDeadLetters(ctx context.Context, ob outboxTarget, wanted map[aggVersion][]store.Key) (map[aggVersion]admin.HeldEvent, error) {
	type agg struct{ typ, id string }
	seen := map[agg]bool{}
	out := map[aggVersion]admin.HeldEvent{}
	for av := range wanted {
		a := agg{av.typ, av.id}
		if seen[a] {
			continue
		}
		seen[a] = true
		list, err := admin.ListHeld(ctx, ob.db, ob.schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter, AggregateType: a.typ, AggregateID: a.id,
			Statuses: []admin.HeldStatus{admin.StatusHeld}, Limit: 10_000})
		if err != nil {
			return nil, fmt.Errorf("read relay dead letters: %w", err)
		}
		for _, d := range list {
			v := aggVersion{d.AggregateType, d.AggregateID, d.AggregateVersion}
			if _, ok := wanted[v]; ok {
				out[v] = d // oldest first: the newest wins
			}
		}
	}
	return out, nil
}

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
