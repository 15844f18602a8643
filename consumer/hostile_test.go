package consumer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/tracing/tracingtest"
)

// thingPayload is what consumertest.Event puts in a payload.
type thingPayload struct {
	ID string `json:"id"`
	V  int64  `json:"v"`
}

// rawRecord is a Kafka record as a hostile producer may write it: any
// headers (repeated keys, no message UUID), any key, any value (nil: a
// tombstone).
type rawRecord struct {
	name    string
	headers []sarama.RecordHeader
	key     []byte
	value   []byte
	offset  int64 // set when published
}

// recordOf is the record the relay would write for e, with its headers in
// a fixed order and an extra custom header.
func recordOf(e eventline.Event) rawRecord {
	md := map[string]string{
		eventline.MetaEventID: e.ID, eventline.MetaEventType: e.Type, eventline.MetaEventVersion: "1",
		eventline.MetaAggregateType: e.AggregateType, eventline.MetaAggregateID: e.AggregateID,
		eventline.MetaOccurredAt: "2026-01-02T03:04:05Z", "tenant": "acme",
	}
	if e.AggregateVersion > 0 {
		md[eventline.MetaAggregateVersion] = strconv.FormatInt(e.AggregateVersion, 10)
	}
	r := rawRecord{headers: []sarama.RecordHeader{{Key: []byte(kafka.UUIDHeaderKey), Value: []byte(e.ID)}}, key: []byte(e.AggregateID), value: e.Payload}
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		for k := range md {
			if !yield(k) {
				return
			}
		}
	}) {
		r.headers = append(r.headers, sarama.RecordHeader{Key: []byte(k), Value: []byte(md[k])})
	}
	return r
}

// set replaces (or adds) header k.
func (r rawRecord) set(k, v string) rawRecord {
	r.headers = slices.Clone(r.headers)
	for i, h := range r.headers {
		if string(h.Key) == k {
			r.headers[i].Value = []byte(v)
			return r
		}
	}
	r.headers = append(r.headers, sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
	return r
}

// drop removes header k.
func (r rawRecord) drop(k string) rawRecord {
	r.headers = slices.DeleteFunc(slices.Clone(r.headers), func(h sarama.RecordHeader) bool { return string(h.Key) == k })
	return r
}

// add appends header k, keeping any earlier one (a repeated key).
func (r rawRecord) add(k, v string) rawRecord {
	r.headers = append(slices.Clone(r.headers), sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
	return r
}

// message is the record as the consumer reads it.
func (r rawRecord) message(t *testing.T) *message.Message {
	msg, err := kafka.DefaultMarshaler{}.Unmarshal(&sarama.ConsumerMessage{Headers: headerPtrs(r.headers), Key: r.key, Value: r.value})
	require.NoError(t, err)
	return msg
}

func headerPtrs(hs []sarama.RecordHeader) []*sarama.RecordHeader {
	out := make([]*sarama.RecordHeader, len(hs))
	for i := range hs {
		out[i] = &hs[i]
	}
	return out
}

// publishRaw publishes records, in order, to partition 0 of topic, with a
// producer that accepts records up to 16 MiB, and records their offsets.
func publishRaw(t *testing.T, brokers []string, topic string, recs []rawRecord) {
	t.Helper()
	cfg := kafkaconf.Producer("test-hostile")
	cfg.Producer.MaxMessageBytes = 16 << 20
	cfg.Producer.Partitioner = sarama.NewManualPartitioner
	p, err := sarama.NewSyncProducer(brokers, cfg)
	require.NoError(t, err)
	defer p.Close()
	for i := range recs {
		pm := &sarama.ProducerMessage{Topic: topic, Partition: 0, Key: sarama.ByteEncoder(recs[i].key), Headers: recs[i].headers}
		if recs[i].value != nil {
			pm.Value = sarama.ByteEncoder(recs[i].value)
		}
		_, off, err := p.SendMessage(pm)
		require.NoError(t, err, "publish %s", recs[i].name)
		recs[i].offset = off
	}
}

// Hostile values a field may be given.
var hostileValues = []string{
	"", " ", "\x00", "a\x00b", "\xff\xfe", "caf\xc3", "\t", "-1", "0", "1e3", " 1", "1 ", "0x10", "1.0",
	"9223372036854775808", "9223372036854775807", "-9223372036854775809", "\u0661", `"1"`, "\x00\x00\x00\x01",
	strings.Repeat("x", 256), strings.Repeat("\x00", 300), "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
	"00-\x00\xff-01", "k=v\x00,k2=\xff", strings.Repeat("k=v,", 1000),
}

// hostileFields are the places a hostile value goes.
var hostileFields = []string{
	eventline.MetaEventID, eventline.MetaEventType, eventline.MetaAggregateType, eventline.MetaAggregateID,
	eventline.MetaAggregateVersion, eventline.MetaEventVersion, eventline.MetaPreviousVersion, eventline.MetaOccurredAt,
	eventline.MetaCorrelationID, eventline.MetaTraceParent, "tracestate", "baggage", eventline.MetaContentType, "tenant", "custom-key", "payload",
	kafka.UUIDHeaderKey,
}

// mutate puts value v into field f of a fresh event of aggregate agg
// (ids and aggregate ids stay unique: the value is prefixed to a unique
// suffix, so two records never collide by accident).
func mutate(agg, f, v string) rawRecord {
	r := recordOf(consumertest.Event(agg, 1))
	switch f {
	case eventline.MetaEventID, eventline.MetaAggregateID:
		return r.set(f, v+"#"+agg)
	case "custom-key":
		return r.set(v, "value")
	case "payload":
		r.value = []byte(v)
		return r
	}
	return r.set(f, v)
}

// expectApplied is the oracle for a record on its own aggregate: whether a
// consumer with the thing.changed JSON handler applies it (else it must be
// dead-lettered as permanent).
func expectApplied(t *testing.T, r rawRecord) (eventline.Event, bool) {
	e, err := eventline.Decode(r.message(t))
	if err != nil || e.Type != "thing.changed" {
		return e, false
	}
	if _, err := eventline.DecodePayload[thingPayload](e); err != nil {
		return e, false
	}
	// A first version of more than MaxGap leaves too many versions missing.
	return e, e.AggregateVersion <= 1
}

// Hostile Kafka records (missing, empty, repeated or malformed headers;
// invalid UTF-8 and NUL bytes in every text field; 1 MiB ids; versions
// that overflow, are negative, zero or not decimal; payloads that are not
// JSON; unknown types; ids and versions that lie), interleaved with valid
// events on one partition, through the ready runner as the README builds
// it. Every valid event is applied once, in order; every hostile record is
// dead-lettered on its first failure (as the event's fault, never after
// retries, its bytes kept exactly) or discarded with a recorded
// outcome (a stale version); the partition's committed offset reaches its
// end.
func TestHostileRecordsCostOnlyThemselves(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("EVENTLINE_HOSTILE_SEED"); s != "" {
		var err error
		seed, err = strconv.ParseUint(s, 10, 64)
		require.NoError(t, err)
	}
	t.Logf("seed %d (EVENTLINE_HOSTILE_SEED=%d reproduces the order and mutations)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, seed))

	k := newKenv(t, 1)
	k.topic = kafkatest.Topic(t, "hostile")
	createBigTopic(t, k.brokers, k.topic)
	const group = "hostile"
	// Everything that reads the records' fields on: metrics (event_type
	// labels), tracing (headers, attributes), debug logging.
	cfg := k.config(group)
	withMetrics(t, &cfg)
	cfg.TracerProvider = tracingtest.New(t).Provider
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelDebug}))
	c := k.newConsumer(t, cfg)
	require.NoError(t, consumer.HandleJSON(c, "thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event, _ thingPayload) error {
		return k.Apply(ctx, tx, group, e)
	}))

	// Valid events: 5 aggregates × 5 versions, each aggregate's versions
	// shuffled (the gate parks early ones).
	var valid []eventline.Event
	var records []rawRecord
	for a := range 5 {
		var evs []eventline.Event
		for v := int64(1); v <= 5; v++ {
			evs = append(evs, consumertest.Event(fmt.Sprintf("agg-%d", a), v))
		}
		valid = append(valid, evs...)
		rng.Shuffle(len(evs), func(i, j int) { evs[i], evs[j] = evs[j], evs[i] })
		for _, e := range evs {
			r := recordOf(e)
			r.name = fmt.Sprintf("valid %s v%d", e.AggregateID, e.AggregateVersion)
			records = append(records, r)
		}
	}

	// Hostile records, each on its own aggregate, or lying about one.
	var bad []hostile
	n := 0
	next := func() string { n++; return fmt.Sprintf("h-%d", n) }
	base := func() rawRecord { return recordOf(consumertest.Event(next(), 1)) }
	mib := strings.Repeat("i", 1<<20)
	fixed := []hostile{
		{rawRecord: rawRecord{name: "no headers, no value"}, reason: "event_id"},
		{rawRecord: rawRecord{name: "no headers, JSON value", value: []byte(`{"id":"x","v":1}`)}, reason: "event_id"},
		{rawRecord: base().drop(eventline.MetaEventID), reason: "event_id"},
		{rawRecord: base().drop(eventline.MetaEventType), reason: "event_type"},
		{rawRecord: base().drop(eventline.MetaAggregateID), reason: "aggregate_id"},
		{rawRecord: base().drop(eventline.MetaAggregateType), reason: "aggregate_type"},
		{rawRecord: base().set(eventline.MetaEventID, "\x00"+next()), reason: "NUL"},
		{rawRecord: base().set(eventline.MetaEventID, next()+"\xff\xfe"), reason: "UTF-8"},
		{rawRecord: base().set(eventline.MetaEventID, mib+next()), reason: "longer than"},
		{rawRecord: base().set(eventline.MetaAggregateID, mib+next()), reason: "longer than"},
		{rawRecord: base().set(eventline.MetaAggregateType, mib), reason: "longer than"},
		{rawRecord: base().set(eventline.MetaEventType, mib), reason: "no handler"},
		{rawRecord: base().set(eventline.MetaCorrelationID, mib), reason: "longer than"},
		{rawRecord: base().set(mib, "v").set(eventline.MetaEventType, "thing.unknown"), reason: "no handler"},
		{rawRecord: base().set(eventline.MetaAggregateID, next()+"\x00"), reason: "NUL"},
		{rawRecord: base().set(eventline.MetaAggregateType, "thi\x00ng"), reason: "NUL"},
		{rawRecord: base().set(eventline.MetaEventType, "thing.changed\x00"), reason: "event type"},
		{rawRecord: base().set(eventline.MetaCorrelationID, "c\x00"), reason: "NUL"},
		{rawRecord: base().set("tenant", "ac\x00me"), reason: "NUL"},
		{rawRecord: base().set("te\x00nant", "acme"), reason: "NUL"},
		{rawRecord: base().set("tenant", "\xc3\x28"), reason: "UTF-8"},
		{rawRecord: base().set(eventline.MetaAggregateVersion, "9223372036854775808"), reason: "aggregate_version"},
		{rawRecord: base().set(eventline.MetaAggregateVersion, "-1"), reason: "aggregate_version"},
		{rawRecord: base().set(eventline.MetaAggregateVersion, "0"), reason: "aggregate_version"},
		{rawRecord: base().set(eventline.MetaAggregateVersion, "1e3"), reason: "aggregate_version"},
		{rawRecord: base().set(eventline.MetaAggregateVersion, " 1"), reason: "aggregate_version"},
		{rawRecord: base().set(eventline.MetaAggregateVersion, "9223372036854775807"), reason: "missing"},
		{rawRecord: base().set(eventline.MetaPreviousVersion, "7"), reason: "aggregate_previous_version"},
		{rawRecord: base().set(eventline.MetaEventVersion, "-1"), reason: "event_version"},
		{rawRecord: base().set(eventline.MetaOccurredAt, "yesterday"), reason: "occurred_at"},
		{rawRecord: base().set(eventline.MetaEventType, "thing.exploded"), reason: "no handler"},
		// A repeated header: the last one wins, and it holds a NUL.
		{rawRecord: base().add(eventline.MetaAggregateID, "x\x00y"), reason: "NUL"},
	}
	for _, payload := range [][]byte{nil, []byte("not json"), []byte("\x00\xff"), []byte(`{"v":"lots"}`), []byte(`{"id":"a"`)} {
		r := base()
		r.value = payload
		fixed = append(fixed, hostile{rawRecord: r, reason: "payload"})
	}
	many := base()
	for i := range 10_000 {
		many = many.add(fmt.Sprintf("h%d", i), "v")
	}
	fixed = append(fixed, hostile{rawRecord: many.set(eventline.MetaEventType, "thing.unknown"), reason: "no handler"})
	for i := range fixed {
		fixed[i].name = fmt.Sprintf("fixed %d", i)
	}
	// 10,000 headers on a valid event: applied (the oracle below agrees).
	many = recordOf(consumertest.Event(next(), 1))
	for i := range 10_000 {
		many = many.add(fmt.Sprintf("h%d", i), "v")
	}
	many.name = "10,000 headers"
	bad = append(bad, fixed...)
	bad = append(bad, hostile{rawRecord: many})
	for range 40 {
		f, v := hostileFields[rng.IntN(len(hostileFields))], hostileValues[rng.IntN(len(hostileValues))]
		h := hostile{rawRecord: mutate(next(), f, v)}
		h.name = fmt.Sprintf("random %d: %s=%q", n, f, printableQ(v))
		bad = append(bad, h)
	}
	for i := range bad {
		bad[i].event, bad[i].applied = expectApplied(t, bad[i].rawRecord)
	}
	for i := range bad {
		if i < len(fixed) {
			require.False(t, bad[i].applied, "%s: the oracle must reject it", bad[i].name)
		}
	}
	require.True(t, bad[len(fixed)].applied, "the oracle accepts 10,000 headers")

	// Interleave: valid records keep their relative order.
	all := slices.Clone(records)
	for _, h := range bad {
		i := rng.IntN(len(all) + 1)
		all = slices.Insert(all, i, h.rawRecord)
	}
	publishRaw(t, k.brokers, k.topic, all)
	offsetOf := map[string]int64{}
	for _, r := range all {
		offsetOf[r.name] = r.offset
	}

	var wantApplied []eventline.Event
	wantApplied = append(wantApplied, valid...)
	wantDead := map[int64]hostile{}
	for _, h := range bad {
		h.offset = offsetOf[h.name]
		if h.applied {
			wantApplied = append(wantApplied, h.event)
		} else {
			wantDead[h.offset] = h
		}
	}

	r := start(t, c)
	end := int64(len(all))
	eventually(t, 90*time.Second, func() bool { return committedOffset(t, k, group) == end }, "the committed offset reaches the end of the partition (%d)", end)
	checkDeadLetters(t, k, group, wantDead)
	appliedOnce(t, k.Effects(t, group), wantApplied)

	// Phase 2, behind the applied events: ids and versions that lie. A
	// valid id on another aggregate is another event there (the id is
	// recorded per aggregate): applied.
	agg0v1 := valid[0]
	require.Equal(t, "agg-0", agg0v1.AggregateID)
	reusedOnOther := consumertest.Event(next(), 1)
	reusedOnOther.ID = agg0v1.ID
	idOtherAggregate := recordOf(reusedOnOther)
	idOtherAggregate.name = "a valid id on another aggregate"
	idOtherVersion := recordOf(consumertest.Event("agg-0", 7)).set(eventline.MetaEventID, agg0v1.ID)
	idOtherVersion.name = "liar: a valid id at another version"
	stale := recordOf(consumertest.Event("agg-1", 3))
	stale.name = "liar: a second event at an applied version"
	ahead := consumertest.Event("agg-2", 7) // parks: 6 is missing
	parkedTwin := recordOf(consumertest.Event("agg-2", 7))
	parkedTwin.name = "liar: a second event at a parked version"
	six := consumertest.Event("agg-2", 6)
	aheadRec, sixRec := recordOf(ahead), recordOf(six)
	aheadRec.name, sixRec.name = "valid agg-2 v7", "valid agg-2 v6"
	phase2 := []rawRecord{idOtherAggregate, idOtherVersion, stale, aheadRec, parkedTwin, sixRec}
	publishRaw(t, k.brokers, k.topic, phase2)
	end += int64(len(phase2))
	eventually(t, 90*time.Second, func() bool { return committedOffset(t, k, group) == end }, "the committed offset reaches the end of the partition (%d)", end)
	require.NoError(t, r.stop())

	wantDead[phase2[1].offset] = hostile{rawRecord: phase2[1], reason: agg0v1.ID} // idOtherVersion
	wantDead[phase2[4].offset] = hostile{rawRecord: phase2[4], reason: "version"} // parkedTwin
	checkDeadLetters(t, k, group, wantDead)
	appliedOnce(t, k.Effects(t, group), append(wantApplied, six, ahead, reusedOnOther))
	staleID := stale.message(t).Metadata.Get(eventline.MetaEventID)
	require.Equal(t, 1, k.Count(t, "processed_events", `WHERE consumer_group = $1 AND event_id = $2 AND outcome = 'stale'`, group, staleID), "the stale liar is recorded as discarded")
	for _, table := range []string{"parked_events", "skipped_versions"} {
		require.Zero(t, k.Count(t, table, `WHERE consumer_group = $1`, group),
			"%s must be empty", table)
	}
	require.Zero(t, k.Count(t, "held_events", `WHERE consumer_group = $1 AND kind = 'late'`, group),
		"no late event held")
}

// A record that carries a genuine event's id for another aggregate, right
// in front of the genuine event in the partition, runs in another lane
// (the laned runner's defaults: 8 lanes, batches of 16) and may record the
// id first. It is a different event of its own aggregate: both are
// applied, nothing is dead-lettered, and the genuine event's aggregate
// goes on. Before: whichever recorded the id second was refused as an id
// conflict (in hostile-record runs, 38–41 of 4,248 genuine events a run),
// and the genuine aggregate's later versions parked behind it.
func TestAnIDReusedInAnotherLaneCostsTheGenuineEventNothing(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "reused"
	cfg := k.config(group)
	cfg.ParkTimeout = time.Hour
	c := k.newConsumer(t, cfg)
	require.NoError(t, consumer.HandleJSON(c, "thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event, _ thingPayload) error {
		return k.Apply(ctx, tx, group, e)
	}))
	var want []eventline.Event
	var msgs []*message.Message
	for i := range 8 {
		agg := fmt.Sprintf("genuine-%d", i)
		g1, g2, g3 := consumertest.Event(agg, 1), consumertest.Event(agg, 2), consumertest.Event(agg, 3)
		reused := consumertest.Event(fmt.Sprintf("reuser-%d", i), 1)
		reused.ID = g1.ID
		want = append(want, reused, g1, g2, g3)
		msgs = append(msgs, consumertest.Message(t, reused), consumertest.Message(t, g1), consumertest.Message(t, g2), consumertest.Message(t, g3))
	}
	publish(t, k.brokers, k.topic, msgs...)
	r := start(t, c)
	end := int64(len(msgs))
	eventually(t, 60*time.Second, func() bool { return committedOffset(t, k, group) == end }, "the committed offset reaches the end of the partition (%d)", end)
	require.NoError(t, r.stop())
	checkDeadLetters(t, k, group, nil)
	appliedOnce(t, k.Effects(t, group), want)
	require.Equal(t, len(want), k.Count(t, "processed_events", `WHERE consumer_group = $1 AND outcome = 'applied'`, group), "a dedup record of every event")
	require.Zero(t, k.Count(t, "parked_events", `WHERE consumer_group = $1`, group))
}

// hostile is a hostile record and what must become of it.
type hostile struct {
	rawRecord
	applied bool            // the oracle says it is a valid event after all
	event   eventline.Event // as decoded, when it decodes
	reason  string          // a dead letter's reason must contain it
}

// checkDeadLetters checks that the group's dead letters are exactly want
// (by Kafka offset): dead-lettered once, on the first failure, as the
// event's fault, with the record's bytes kept exactly.
func checkDeadLetters(t *testing.T, k kenv, group string, want map[int64]hostile) {
	t.Helper()
	dead, err := admin.ListHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{Kind: admin.HeldDeadLetter, Group: group, Limit: 100_000})
	require.NoError(t, err)
	got := map[int64]bool{}
	for _, d := range dead {
		require.True(t, d.FromKafka, "dead letter %d locates its record", d.ID)
		h, ok := want[d.Offset]
		require.True(t, ok, "offset %d was dead-lettered but is valid: %s", d.Offset, d.Reason)
		require.False(t, got[d.Offset], "offset %d dead-lettered twice", d.Offset)
		got[d.Offset] = true
		require.NotContains(t, []string{dedup.KindRetriesExhausted, dedup.KindFailed}, d.Cause, "%s: the event's fault, not retried: %s", h.name, d.Reason)
		require.Equal(t, 1, d.Times, "%s: dead-lettered once", h.name)
		require.Contains(t, d.Reason, h.reason, "%s", h.name)
		msg := h.message(t)
		require.Equal(t, msg.UUID, d.MessageUUID, "%s: message UUID kept", h.name)
		require.Equal(t, nonNil(msg.Payload), nonNil(d.Payload), "%s: payload kept byte for byte", h.name)
		require.Equal(t, map[string]string(msg.Metadata), d.Metadata, "%s: headers kept byte for byte", h.name)
	}
	for off, h := range want {
		require.True(t, got[off], "%s (offset %d) must be dead-lettered", h.name, off)
	}
}

func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

func printableQ(s string) string {
	if len(s) > 16 {
		return s[:16] + "…"
	}
	return s
}

// refPayload is what the typed-columns handler writes.
type refPayload struct {
	Name   string          `json:"name"`
	Ref    string          `json:"ref"`
	Doc    json.RawMessage `json:"doc"`
	Amount int64           `json:"amount"`
}

// Content that decodes but that PostgreSQL refuses in the handler's
// columns (a NUL byte in text, SQLSTATE 22021; a malformed uuid, 22P02; a
// \u0000 in jsonb, 22P05; an event id that is not a UUID written to a
// uuid column) or that pgx cannot encode for its column (a number beyond
// int4) is the event's fault: dead-lettered on the first failure,
// in order or inside a batch with valid events of its aggregate, and,
// when it was parked first, given up at once when its turn comes (held
// late, its version audited as skipped) instead of failing release after
// release. The valid events around it are applied once, in order.
func TestContentPostgreSQLRejectsIsTheEventsFault(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "typed"
	refs := k.CreateTable(t, "refs", `event_ref uuid NOT NULL, name text NOT NULL, ref uuid NOT NULL, doc jsonb NOT NULL, amount integer NOT NULL`)
	c := k.newConsumer(t, k.config(group))
	require.NoError(t, consumer.HandleJSON(c, "thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event, p refPayload) error {
		if _, err := tx.Exec(ctx, `INSERT INTO `+refs+` (event_ref, name, ref, doc, amount) VALUES ($1, $2, $3, $4, $5)`, e.ID, p.Name, p.Ref, string(p.Doc), p.Amount); err != nil {
			return err
		}
		return k.Apply(ctx, tx, group, e)
	}))

	good := `{"name":"ok","ref":"0190a7e2-6b1c-7b3e-9f00-000000000001","doc":{"a":1}}`
	event := func(agg string, v int64, payload string) eventline.Event {
		e := consumertest.Event(agg, v)
		e.Payload = []byte(payload)
		return e
	}
	hostilePayloads := map[string]string{
		"22021": `{"name":"a\u0000b","ref":"0190a7e2-6b1c-7b3e-9f00-000000000001","doc":{}}`,
		"22P02": `{"name":"ok","ref":"not-a-uuid","doc":{}}`,
		"22P05": `{"name":"ok","ref":"0190a7e2-6b1c-7b3e-9f00-000000000001","doc":{"a":"\u0000"}}`,
		"int4":  `{"name":"ok","ref":"0190a7e2-6b1c-7b3e-9f00-000000000001","doc":{},"amount":4294967296}`,
	}
	var want []eventline.Event
	var msgs []*message.Message
	wantDead := map[string]string{} // event id → SQLSTATE, or what pgx says
	codes := slices.Sorted(func(yield func(string) bool) {
		for c := range hostilePayloads {
			if !yield(c) {
				return
			}
		}
	})
	// In order, each between valid events of its aggregate (so in one
	// batch with them).
	for i, code := range append(codes, "not-a-uuid") {
		agg := fmt.Sprintf("agg-%d", i)
		v1, v2 := event(agg, 1, good), event(agg, 2, good)
		bad := event(agg, 2, hostilePayloads[code])
		if code == "not-a-uuid" {
			bad = event(agg, 2, good)
			bad.ID = "evt-" + agg
			code = "22P02"
		}
		v3 := event(agg, 3, good)
		want = append(want, v1, v2, v3)
		wantDead[bad.ID] = code
		// v2 and its hostile twin: the first to arrive is applied. Put
		// the hostile one first: it fails, and the genuine v2 follows.
		msgs = append(msgs, consumertest.Message(t, v1), consumertest.Message(t, bad), consumertest.Message(t, v2), consumertest.Message(t, v3))
	}
	// Parked first: v2 arrives before v1, parks (its payload decodes), and
	// fails when v1 releases it.
	parkedBad := event("parked", 2, hostilePayloads["22021"])
	p1, p3 := event("parked", 1, good), event("parked", 3, good)
	msgs = append(msgs, consumertest.Message(t, parkedBad), consumertest.Message(t, p1), consumertest.Message(t, p3))
	want = append(want, p1, p3)

	publish(t, k.brokers, k.topic, msgs...)
	r := start(t, c)
	end := int64(len(msgs))
	eventually(t, 60*time.Second, func() bool { return committedOffset(t, k, group) == end }, "the committed offset reaches the end of the partition (%d)", end)
	dead, err := admin.ListHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{Kind: admin.HeldDeadLetter, Group: group})
	require.NoError(t, err)
	require.Len(t, dead, len(wantDead))
	for _, d := range dead {
		code, ok := wantDead[d.EventID]
		require.True(t, ok, "unexpected dead letter %s: %s", d.EventID, d.Reason)
		require.Equal(t, dedup.KindPermanent, d.Cause, "%s: the event's fault, dead-lettered without retries: %s", d.EventID, d.Reason)
		require.Equal(t, 1, d.Times)
		if code != "int4" {
			code = "SQLSTATE " + code
		}
		require.Contains(t, d.Reason, code)
	}
	eventually(t, 30*time.Second, func() bool { return len(k.Effects(t, group)) >= len(want) }, "the valid events are applied")
	require.NoError(t, r.stop())
	appliedOnce(t, k.Effects(t, group), want)
	var reason string
	require.NoError(t, k.Pool.QueryRow(context.Background(), `SELECT reason FROM `+sqlident.Qualify(k.Schema, "held_events")+
		` WHERE consumer_group = $1 AND event_id = $2 AND kind = 'late' AND cause = 'release_failed' AND attempts <= 1`, group, parkedBad.ID).Scan(&reason),
		"the parked event is given up at its first failed release")
	require.Contains(t, reason, "SQLSTATE 22021")
	require.Equal(t, 1, k.Count(t, "skipped_versions", `WHERE consumer_group = $1 AND aggregate_id = 'parked' AND from_version = 2 AND to_version = 2`, group))
	require.Zero(t, k.Count(t, "parked_events", `WHERE consumer_group = $1`, group))
}

// Ids and versions that lie, inside one batch transaction with the events
// they lie about (one lane, batches of 16, all published before the
// consumer starts): an id reused at another version of its aggregate is
// refused as an id conflict, and the same id on another aggregate is
// another event there (applied); a second event at an applied version is
// discarded as stale; a second event at a parked version is refused as a
// park conflict; a duplicate is skipped; hostile records in the middle are
// dead-lettered. Everything else is applied once, in order, and the
// partition's offset reaches its end.
func TestLiesInsideOneBatch(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "liars"
	cfg := batchConfig(k, group, 16)
	cfg.SweepInterval, cfg.ParkTimeout = time.Hour, time.Hour
	c := k.newConsumer(t, cfg)
	require.NoError(t, consumer.HandleJSON(c, "thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event, _ thingPayload) error {
		return k.Apply(ctx, tx, group, e)
	}))
	x1, x2, x3 := consumertest.Event("x", 1), consumertest.Event("x", 2), consumertest.Event("x", 3)
	reusedAtV2 := consumertest.Event("x", 2)
	reusedAtV2.ID = x1.ID
	staleV2 := consumertest.Event("x", 2)
	y1 := consumertest.Event("y", 1)
	reusedOnZ := consumertest.Event("z", 1)
	reusedOnZ.ID = x1.ID
	w2, w3, w3twin := consumertest.Event("w", 2), consumertest.Event("w", 3), consumertest.Event("w", 3)
	w1 := consumertest.Event("w", 1)
	nul := recordOf(consumertest.Event("n", 1)).set(eventline.MetaAggregateID, "n\x00").message(t)
	notJSONMsg := consumertest.Message(t, consumertest.Event("j", 1))
	notJSONMsg.Payload = []byte("{")
	msgs := []*message.Message{
		consumertest.Message(t, x1), consumertest.Message(t, reusedAtV2), nul, consumertest.Message(t, x2),
		consumertest.Message(t, w3), consumertest.Message(t, staleV2), consumertest.Message(t, y1), notJSONMsg,
		consumertest.Message(t, reusedOnZ), consumertest.Message(t, w3twin), consumertest.Message(t, x2), consumertest.Message(t, w2),
		consumertest.Message(t, w1), consumertest.Message(t, x3),
	}
	publish(t, k.brokers, k.topic, msgs...)
	r := start(t, c)
	end := int64(len(msgs))
	eventually(t, 60*time.Second, func() bool { return committedOffset(t, k, group) == end }, "the committed offset reaches the end of the partition (%d)", end)
	require.NoError(t, r.stop())
	appliedOnce(t, k.Effects(t, group), []eventline.Event{x1, x2, x3, y1, reusedOnZ, w1, w2, w3})

	dead, err := admin.ListHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{Kind: admin.HeldDeadLetter, Group: group})
	require.NoError(t, err)
	got := map[int64]string{}
	for _, d := range dead {
		require.NotContains(t, []string{dedup.KindRetriesExhausted, dedup.KindFailed}, d.Cause, "offset %d: the event's fault: %s", d.Offset, d.Reason)
		require.Equal(t, 1, d.Times)
		got[d.Offset] = d.Cause
	}
	require.Equal(t, map[int64]string{1: dedup.KindIDConflict, 2: dedup.KindPermanent, 7: dedup.KindPermanent, 9: dedup.KindPermanent}, got)
	require.Equal(t, 1, k.Count(t, "processed_events", `WHERE consumer_group = $1 AND event_id = $2 AND outcome = 'stale'`, group, staleV2.ID), "the stale liar is recorded as discarded")
	for _, table := range []string{"parked_events", "skipped_versions"} {
		require.Zero(t, k.Count(t, table, `WHERE consumer_group = $1`, group),
			"%s must be empty", table)
	}
	require.Zero(t, k.Count(t, "held_events", `WHERE consumer_group = $1 AND kind = 'late'`, group),
		"no late event held")
}
