package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/producer"
	"github.com/jackc/pgx/v5/pgxpool"
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
