package producer

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
)

// A plan is everything PublishTx knows before it runs SQL: the events with
// their defaults, each aggregate's share of the call, and each event's
// outbox envelope with the aggregate version (and, when it is not the
// version before, the previous version) left out, for the database to fill
// in once it has allocated them.
type plan struct {
	events []eventline.Event
	// aggs holds one entry per aggregate, sorted by (type, id) in byte
	// order: the order in which every publish statement locks the
	// aggregates' sequence rows, whatever the database's collation.
	aggs []aggPlan
	// Per event, in call order (the arrays the statement unnests).
	evAgg   []int32  // 1-based index into aggs
	evRel   []int64  // position among its aggregate's events, from 1
	evVer   []int64  // version when known without the database, else 0
	evPrev  []int64  // previous version when known without the database, else -1
	evShard []int32  // outbox shard
	evHead  []string // envelope up to the previous-version slot
	evMid   []string // envelope after that slot, up to the version's digits
	evTail  []string // envelope after the version's digits
	shards  []int    // distinct shards, ascending
	// orig maps an event of a subset (see subset) to its index in the
	// call; nil for the whole call.
	orig []int
}

// index is event i's index in the call.
func (pl *plan) index(i int) int {
	if pl.orig == nil {
		return i
	}
	return pl.orig[i]
}

// aggPlan is one aggregate's part of a call. Its events take versions
// base+1, base+2, ... up to the first supplied version; from there on every
// version is known in advance. base is the aggregate's last published
// version, which only the database knows.
type aggPlan struct {
	typ, id, topic string
	events         []int // indexes into plan.events
	n              int64 // number of events
	lead           int64 // events before the first supplied version
	firstSupplied  int64 // 0 when no version is supplied
	last           int64 // the last event's version when known in advance, else 0
	// caller: the aggregate's type is in Config.CallerVersionedTypes;
	// every version is the caller's, and no sequence row is involved.
	caller bool
}

// next is the version the aggregate's first supplied version must have
// (without gaps), given its last published version.
func (a *aggPlan) next(current int64) int64 { return current + a.lead + 1 }

// forwarderEnvelope is Watermill's forwarder envelope
// (components/forwarder.messageEnvelope), field for field: the outbox
// payload the relay, a forwarder, unwraps. encoding/json writes it exactly
// as the forwarder's DefaultMarshaler does.
type forwarderEnvelope struct {
	DestinationTopic string            `json:"destination_topic"`
	UUID             string            `json:"uuid"`
	Payload          []byte            `json:"payload"`
	Metadata         map[string]string `json:"metadata"`
}

// Placeholders the database replaces: their JSON spellings cannot occur
// anywhere else in an envelope (metadata values cannot hold NUL or other
// control bytes unescaped, and keys are unique).
var (
	prevSlot    = []byte(`"` + eventline.MetaPreviousVersion + `":"\u0001",`)
	versionSlot = []byte(`"` + eventline.MetaAggregateVersion + `":"\u0000"`)
	versionKey  = len(`"` + eventline.MetaAggregateVersion + `":"`)
)

// maxVersionDigits is the length of the largest int64; the size check
// counts it for versions the outbox assigns.
const maxVersionDigits = 19

// prepare validates events, fills in their defaults (the caller's trace
// context from ctx, see traceHeaders) and builds the plan, without SQL.
func (p *Producer) prepare(ctx context.Context, events []eventline.Event) (*plan, error) {
	now, trace := time.Now(), p.traceHeaders(ctx)
	pl := &plan{
		events:  make([]eventline.Event, len(events)),
		evAgg:   make([]int32, len(events)),
		evRel:   make([]int64, len(events)),
		evVer:   make([]int64, len(events)),
		evPrev:  make([]int64, len(events)),
		evShard: make([]int32, len(events)),
		evHead:  make([]string, len(events)),
		evMid:   make([]string, len(events)),
		evTail:  make([]string, len(events)),
	}
	byKey := make(map[aggregateKey]*aggPlan, len(events))
	var order []*aggPlan
	// Ids given twice in one call: consumers would apply the first event
	// and refuse the second as an id conflict.
	var ids map[string]int
	if len(events) > 1 {
		ids = make(map[string]int, len(events))
	}
	for i, e := range events {
		e, err := p.withDefaults(i, e, now, trace)
		if err != nil {
			return nil, err
		}
		if ids != nil {
			if j, dup := ids[e.ID]; dup {
				return nil, fmt.Errorf("event %d: %w", i, &eventline.InvalidEventError{Field: eventline.MetaEventID, Value: e.ID,
					Reason: fmt.Sprintf("event %d of the same call has it too: give each event its own id (or leave ID empty for a new one)", j)})
			}
			ids[e.ID] = i
		}
		// Validates the event (Encode does), checks its size and builds
		// its outbox envelope.
		if err := p.envelope(pl, i, e); err != nil {
			return nil, err
		}
		k := aggregateKey{e.AggregateType, e.AggregateID}
		a := byKey[k]
		if a == nil {
			a = &aggPlan{typ: k.typ, id: k.id, topic: e.Topic, caller: p.callerVersioned[k.typ]}
			byKey[k] = a
			order = append(order, a)
		}
		if e.Topic != a.topic {
			return nil, fmt.Errorf("event %d: %w", i, &TopicConflictError{AggregateType: k.typ, AggregateID: k.id, Topic: a.topic, Requested: e.Topic})
		}
		if err := a.add(i, &e, p.cfg.AllowVersionGaps, &pl.evVer[i], &pl.evPrev[i]); err != nil {
			return nil, fmt.Errorf("event %d: %w", i, err)
		}
		pl.evRel[i] = a.n
		pl.evShard[i] = int32(outbox.ShardFor(k.typ, k.id, p.shards))
		pl.events[i] = e
	}

	slices.SortFunc(order, func(a, b *aggPlan) int { return cmp.Or(strings.Compare(a.typ, b.typ), strings.Compare(a.id, b.id)) })
	pl.aggs = make([]aggPlan, len(order))
	for ai, a := range order {
		pl.aggs[ai] = *a
		for _, i := range a.events {
			pl.evAgg[i] = int32(ai + 1)
		}
	}
	pl.setShards()
	return pl, nil
}

// setShards sets shards to the distinct shards of the events, ascending.
func (pl *plan) setShards() {
	pl.shards = make([]int, len(pl.evShard))
	for i, s := range pl.evShard {
		pl.shards[i] = int(s)
	}
	slices.Sort(pl.shards)
	pl.shards = slices.Compact(pl.shards)
}

// callerAggs counts the call's aggregates whose versions are the
// caller's.
func (pl *plan) callerAggs() int {
	n := 0
	for _, a := range pl.aggs {
		if a.caller {
			n++
		}
	}
	return n
}

// subset returns the part of pl whose aggregates' versions are the
// caller's (caller set) or not, with orig mapping its events to pl's.
func (pl *plan) subset(caller bool) *plan {
	sub := &plan{}
	aggIndex := map[int]int32{} // pl's aggregate → sub's, 1-based
	for ai, a := range pl.aggs {
		if a.caller == caller {
			sub.aggs = append(sub.aggs, a)
			aggIndex[ai] = int32(len(sub.aggs))
		}
	}
	eventIndex := map[int]int{} // pl's event → sub's
	for i := range pl.events {
		ai, ok := aggIndex[int(pl.evAgg[i])-1]
		if !ok {
			continue
		}
		eventIndex[i] = len(sub.events)
		sub.orig = append(sub.orig, pl.index(i))
		sub.events = append(sub.events, pl.events[i])
		sub.evAgg = append(sub.evAgg, ai)
		sub.evRel = append(sub.evRel, pl.evRel[i])
		sub.evVer = append(sub.evVer, pl.evVer[i])
		sub.evPrev = append(sub.evPrev, pl.evPrev[i])
		sub.evShard = append(sub.evShard, pl.evShard[i])
		sub.evHead = append(sub.evHead, pl.evHead[i])
		sub.evMid = append(sub.evMid, pl.evMid[i])
		sub.evTail = append(sub.evTail, pl.evTail[i])
	}
	sub.setShards()
	for k := range sub.aggs {
		events := make([]int, len(sub.aggs[k].events))
		for j, i := range sub.aggs[k].events {
			events[j] = eventIndex[i]
		}
		sub.aggs[k].events = events
	}
	return sub
}

// body is event i's outbox payload with its known version and previous
// version spliced in, as the publish statements splice them.
func (pl *plan) body(i int) string {
	v, prev := pl.evVer[i], pl.evPrev[i]
	var b strings.Builder
	b.Grow(len(pl.evHead[i]) + len(pl.evMid[i]) + len(pl.evTail[i]) + 64)
	b.WriteString(pl.evHead[i])
	if prev != v-1 {
		b.WriteString(`"` + eventline.MetaPreviousVersion + `":"`)
		b.WriteString(strconv.FormatInt(prev, 10))
		b.WriteString(`",`)
	}
	b.WriteString(pl.evMid[i])
	b.WriteString(strconv.FormatInt(v, 10))
	b.WriteString(pl.evTail[i])
	return b.String()
}

// withDefaults fills in what the producer owns: the default topic, the
// declared schema version, the caller's trace context, the id and the
// time. The event is validated afterwards, by Encode (see envelope).
func (p *Producer) withDefaults(i int, e eventline.Event, now time.Time, trace map[string]string) (eventline.Event, error) {
	if e.Topic == "" {
		e.Topic = p.cfg.DefaultTopic
	}
	if e.Topic == "" {
		return e, fmt.Errorf("event %d: %w", i, &eventline.InvalidEventError{Field: "topic", Reason: "must not be empty: set Event.Topic or producer.Config.DefaultTopic"})
	}
	// The producer decides which version an event follows.
	e.PreviousVersion = 0
	if declared, ok := p.cfg.SchemaVersions[e.Type]; ok {
		switch {
		case e.SchemaVersion == 0:
			e.SchemaVersion = declared
		case e.SchemaVersion > declared:
			return e, &SchemaVersionError{Index: i, EventType: e.Type, Version: e.SchemaVersion, Declared: declared}
		}
	}
	if e.AggregateVersion < 0 {
		// The only check Encode cannot make: it sees the event without
		// its version.
		return e, fmt.Errorf("event %d: %w", i, &eventline.InvalidEventError{
			Field: eventline.MetaAggregateVersion, Value: strconv.FormatInt(e.AggregateVersion, 10), Reason: "must not be negative"})
	}
	if e.TraceParent == "" && len(trace) > 0 {
		e = withTrace(e, trace)
	}
	return e.WithDefaults(now), nil
}

// add appends event i (e) to the aggregate, checking a supplied version
// against the events before it in the call, and sets the event's version
// and previous version when they are known without the database.
func (a *aggPlan) add(i int, e *eventline.Event, allowGaps bool, ver, prev *int64) error {
	a.events = append(a.events, i)
	a.n++
	known := a.firstSupplied != 0
	if a.caller && e.AggregateVersion == 0 {
		return &eventline.InvalidEventError{
			Field: eventline.MetaAggregateVersion, Value: "0",
			Reason: fmt.Sprintf("aggregate type %q takes its versions from the caller (producer.Config.CallerVersionedTypes): set AggregateVersion", a.typ),
		}
	}
	if a.caller && !known {
		// The caller's version follows the one before it, which the
		// caller's lock vouches for.
		a.firstSupplied, a.last = e.AggregateVersion, e.AggregateVersion
		*ver, *prev = e.AggregateVersion, e.AggregateVersion-1
		e.PreviousVersion = *prev
		return nil
	}
	switch v := e.AggregateVersion; {
	case v == 0 && known && a.last == math.MaxInt64:
		return &eventline.InvalidEventError{
			Field: eventline.MetaAggregateVersion, Value: "0",
			Reason: fmt.Sprintf("would follow version %d, the largest there is", a.last),
		}
	case v == 0 && known:
		*ver, *prev = a.last+1, a.last
	case v == 0:
		*ver, *prev = 0, -1
		a.lead++
		return nil
	case known && v <= a.last:
		return &eventline.InvalidEventError{
			Field: eventline.MetaAggregateVersion, Value: strconv.FormatInt(v, 10),
			Reason: fmt.Sprintf("must be greater than version %d, given or assigned earlier in the same call", a.last),
		}
	case known && v != a.last+1 && !allowGaps:
		return &VersionGapError{AggregateType: a.typ, AggregateID: a.id, Version: v, Next: a.last + 1}
	case known:
		*ver, *prev = v, a.last
	default:
		// The first supplied version: the database checks it against the
		// aggregate's last version.
		a.firstSupplied = v
		*ver, *prev = v, -1
	}
	a.last = *ver
	e.AggregateVersion, e.PreviousVersion = *ver, *prev
	if *prev < 0 {
		e.PreviousVersion = 0
	}
	return nil
}

// envelope encodes event i as the outbox row's payload, split around the
// version slots, and checks the size of the Kafka record it becomes.
func (p *Producer) envelope(pl *plan, i int, e eventline.Event) error {
	// Encode with no version: the slots are added below, and the database
	// writes the numbers.
	noVersion := e
	noVersion.AggregateVersion, noVersion.PreviousVersion = 0, 0
	msg, err := eventline.Encode(noVersion)
	if err != nil {
		return fmt.Errorf("event %d: %w", i, err)
	}
	if err := p.checkSize(i, e, msg); err != nil {
		return err
	}
	msg.Metadata[eventline.MetaAggregateVersion] = "\x00"
	msg.Metadata[eventline.MetaPreviousVersion] = "\x01"
	body, err := json.Marshal(forwarderEnvelope{DestinationTopic: e.Topic, UUID: msg.UUID, Payload: msg.Payload, Metadata: msg.Metadata})
	if err != nil {
		return fmt.Errorf("event %d: encode outbox envelope: %w", i, err)
	}
	ps := bytes.Index(body, prevSlot)
	vs := bytes.Index(body, versionSlot)
	if ps < 0 || vs < ps {
		return fmt.Errorf("event %d: encode outbox envelope: version slots not found", i) // unreachable
	}
	pl.evHead[i] = string(body[:ps])
	pl.evMid[i] = string(body[ps+len(prevSlot) : vs+versionKey])
	pl.evTail[i] = string(body[vs+len(versionSlot)-1:])
	return nil
}

// checkSize refuses an event whose Kafka record would exceed
// MaxMessageBytes. msg has no version metadata yet; the size counts the
// version's digits (the largest possible when the outbox assigns it) and,
// when gaps are allowed, a previous version.
func (p *Producer) checkSize(i int, e eventline.Event, msg *message.Message) error {
	size := EncodedRecordSize(msg)
	digits := maxVersionDigits
	if e.AggregateVersion > 0 {
		digits = len(strconv.FormatInt(e.AggregateVersion, 10))
	}
	size += len(eventline.MetaAggregateVersion) + digits + headerOverhead
	if p.cfg.AllowVersionGaps {
		size += len(eventline.MetaPreviousVersion) + maxVersionDigits + headerOverhead
	}
	if size > p.cfg.MaxMessageBytes {
		return &EventTooLargeError{Index: i, EventID: e.ID, AggregateType: e.AggregateType, AggregateID: e.AggregateID, Size: size, Limit: p.cfg.MaxMessageBytes}
	}
	return nil
}

// Sarama's size estimate of one record (ProducerMessage.ByteSize for record
// batches, Kafka ≥ 0.11): a fixed overhead per record plus, per header, two
// varints' worth of length prefixes. The constants mirror Sarama's
// maximumRecordOverhead and binary.MaxVarintLen32 so the producer refuses
// exactly what Sarama would.
const (
	recordOverhead = 5*binary.MaxVarintLen32 + binary.MaxVarintLen64 + 1
	headerOverhead = 2 * binary.MaxVarintLen32
)

// EncodedRecordSize returns the size Sarama compares with
// Producer.MaxMessageBytes for the Kafka record the relay builds from msg,
// an event message as [eventline.Encode] returns it: the record key (the
// aggregate id), the payload, one header per metadata entry plus
// watermill-kafka's message UUID header, and the per-record overhead. A
// record is sent only when this is at most the relay's MaxMessageBytes.
func EncodedRecordSize(msg *message.Message) int {
	if msg == nil {
		return 0
	}
	size := recordOverhead + len(msg.Metadata.Get(eventline.MetaAggregateID)) + len(msg.Payload)
	size += len(kafka.UUIDHeaderKey) + len(msg.UUID) + headerOverhead
	for k, v := range msg.Metadata {
		size += len(k) + len(v) + headerOverhead
	}
	return size
}

// traceHeaders returns the caller's trace context as the propagator writes
// it (for the W3C propagators: traceparent, tracestate and baggage), or nil
// when ctx carries neither a valid span context nor baggage, in which case
// the propagator is not called at all.
func (p *Producer) traceHeaders(ctx context.Context) map[string]string {
	if !trace.SpanContextFromContext(ctx).IsValid() && baggage.FromContext(ctx).Len() == 0 {
		return nil
	}
	prop := p.cfg.Propagator
	if prop == nil {
		prop = otel.GetTextMapPropagator()
	}
	carrier := propagation.MapCarrier{}
	prop.Inject(ctx, carrier)
	if len(carrier) == 0 {
		return nil
	}
	return carrier
}

// withTrace returns e carrying the trace headers: traceparent in
// TraceParent, every other header in Metadata unless the caller set that
// key already. The caller's Metadata map is copied, never modified.
func withTrace(e eventline.Event, headers map[string]string) eventline.Event {
	md := e.Metadata
	copied := false
	for k, v := range headers {
		if k == eventline.MetaTraceParent {
			e.TraceParent = v
			continue
		}
		if _, set := md[k]; set {
			continue
		}
		if !copied {
			md = make(map[string]string, len(e.Metadata)+len(headers))
			maps.Copy(md, e.Metadata)
			copied = true
		}
		md[k] = v
	}
	e.Metadata = md
	return e
}
