package middleware_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/tracing/tracingtest"
	"github.com/eventline/eventline/middleware"
)

// hostileFields are the metadata keys (and "payload") a hostile message
// may corrupt.
var hostileFields = []string{
	eventline.MetaEventID, eventline.MetaEventType, eventline.MetaAggregateType, eventline.MetaAggregateID,
	eventline.MetaAggregateVersion, eventline.MetaEventVersion, eventline.MetaPreviousVersion, eventline.MetaOccurredAt,
	eventline.MetaCorrelationID, eventline.MetaTraceParent, eventline.MetaContentType, "tracestate", "baggage",
	"tenant", "payload",
}

// hostileValue draws a value a hostile producer may write: numbers that
// overflow or are not decimal, NUL bytes, invalid UTF-8, blanks, long
// strings, arbitrary bytes.
func hostileValue() *rapid.Generator[string] {
	return rapid.OneOf(
		rapid.SampledFrom([]string{
			"", " ", "\x00", "a\x00b", "\xff\xfe", "caf\xc3", "\t", "-1", "0", "1", "2", "1e3", " 1", "1 ", "+1", "0x10", "1.0",
			"9223372036854775807", "9223372036854775808", "-9223372036854775809", "\u0661", `"1"`,
			strings.Repeat("x", 255), strings.Repeat("x", 256), strings.Repeat("é", 200), strings.Repeat("\x00", 300), strings.Repeat("y", 1<<20),
			`{"name":"a\u0000b"}`, `{"name":"ok"}`, `{"name":1}`, "null", "{",
		}),
		rapid.String(),
		rapid.StringOf(rapid.RuneFrom([]rune{0, 'a', 0xFFFD, 0x10FFFF, '"', '\\'})),
		rapid.Map(rapid.SliceOfN(rapid.Byte(), 0, 64), func(b []byte) string { return string(b) }),
	)
}

// hostileMessage draws a message of its own aggregate (so no two collide
// by accident) with one to three fields corrupted, or removed. With an id
// it carries that id (a valid event's, reused on its own aggregate) unless
// a mutation replaces it.
func hostileMessage(agg, id string) *rapid.Generator[*message.Message] {
	return rapid.Custom(func(rt *rapid.T) *message.Message {
		e := consumertest.Event(agg, 1)
		if id != "" {
			e.ID = id
		}
		e.Payload = []byte(`{"name":"ok"}`)
		msg := consumertest.Message(rt, e)
		msg.Metadata.Set("tenant", "acme")
		if rapid.Bool().Draw(rt, "hostile content") {
			// Content that decodes, for PostgreSQL to judge: a name with
			// or without NUL bytes (text), a ref that may not be a UUID.
			p := content{
				Name:   rapid.StringOf(rapid.RuneFrom([]rune{0, 'a', 'é', 0x10FFFF})).Draw(rt, "name"),
				Ref:    rapid.SampledFrom([]string{"", validRef, "not-a-uuid", "0190a7e2"}).Draw(rt, "ref"),
				Amount: rapid.SampledFrom([]int64{0, 1, math.MaxInt32, math.MaxInt32 + 1, math.MinInt32 - 1, math.MinInt64}).Draw(rt, "amount"),
			}
			msg.Payload, _ = json.Marshal(p)
			if rapid.Bool().Draw(rt, "content only") {
				return msg
			}
		}
		for range rapid.IntRange(1, 3).Draw(rt, "mutations") {
			f := rapid.SampledFrom(hostileFields).Draw(rt, "field")
			if rapid.IntRange(0, 9).Draw(rt, "remove") == 0 {
				delete(msg.Metadata, f)
				continue
			}
			v := hostileValue().Draw(rt, "value")
			switch f {
			case "payload":
				msg.Payload = []byte(v)
			case eventline.MetaEventID, eventline.MetaAggregateID:
				msg.Metadata.Set(f, v+"#"+agg) // still unique
			default:
				msg.Metadata.Set(f, v)
			}
		}
		return msg
	})
}

// countedChain is the chain AddHandler builds (f.el.Chain) around handle,
// which gets the event and its transaction, with its calls counted.
func (f *fixture) countedChain(handle func(ctx context.Context, tx pgx.Tx, e eventline.Event) error) (message.HandlerFunc, *atomic.Int64) {
	var calls atomic.Int64
	return f.el.Chain("billing", func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		ctx := msg.Context()
		tx, _ := middleware.TxFromContext(ctx)
		e, _ := middleware.EventFromContext(ctx)
		return nil, handle(ctx, tx, e)
	}), &calls
}

// TestPropertyHostileMessagesCostOnlyThemselves sends random hostile
// messages (see hostileMessage; some reuse a valid event's id on their own
// aggregate, arriving before or after it), interleaved with an aggregate's
// valid events delivered out of order, through the safe chain (DeadLetter
// ▸ Retry ▸ eventline ▸ handler) as records of one partition. The handler
// writes fields of the payload to text, uuid and integer columns, so
// content PostgreSQL refuses (a NUL byte: SQLSTATE 22021; a malformed
// uuid: 22P02) or pgx cannot encode (a number beyond int4) reaches it too.
// It checks that:
//
//   - the chain acknowledges every message (no error: nothing is left to
//     be redelivered forever) and never panics;
//   - a message that does not decode, or whose content PostgreSQL or pgx
//     refuses, is dead-lettered on its first attempt as the event's
//     fault (never after retries), once, with its payload and headers
//     byte for byte; a message that decodes and can be stored is applied,
//     parked or refused as the gate says, with a dedup record or a dead
//     letter; a message the gate parks (or finds stale) has not reached
//     the handler, so its content is not judged yet, whatever it holds;
//   - the valid events are all applied once, in order: a hostile message
//     that reuses a valid event's id on another aggregate is another
//     event there (the id is recorded per aggregate), whichever comes
//     first.
func TestPropertyHostileMessagesCostOnlyThemselves(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{MaxRetries: 2, Retry: eventline.Backoff{Initial: time.Millisecond, Max: time.Millisecond}})
	names := f.env.CreateTable(t, "names", `event_id text NOT NULL, name text NOT NULL, ref uuid, amount integer NOT NULL`)
	chain, attempts := f.countedChain(func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		var p content
		if json.Unmarshal(e.Payload, &p) == nil && (p.Name != "" || p.Ref != "" || p.Amount != 0) {
			ref := &p.Ref
			if p.Ref == "" {
				ref = nil
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+names+` (event_id, name, ref, amount) VALUES ($1, $2, $3, $4)`, e.ID, p.Name, ref, p.Amount); err != nil {
				return err
			}
		}
		return f.env.Apply(ctx, tx, group, e)
	})
	st := f.el.DeadLetterStore()
	var run, offset atomic.Int64
	rapid.Check(t, func(rt *rapid.T) {
		r := run.Add(1)
		valid := fmt.Sprintf("valid-%d", r)
		n := rapid.IntRange(1, 5).Draw(rt, "valid events")
		order := rapid.Permutation(versionsUpTo(n)).Draw(rt, "valid order")
		validEvents := map[int64]eventline.Event{}
		for _, v := range order {
			validEvents[v] = consumertest.Event(valid, v)
		}
		hostile := make([]*message.Message, rapid.IntRange(1, 5).Draw(rt, "hostile messages"))
		for i := range hostile {
			var reused string
			if rapid.Bool().Draw(rt, "reuse a valid id") {
				reused = validEvents[rapid.Int64Range(1, int64(n)).Draw(rt, "reused version")].ID
			}
			hostile[i] = hostileMessage(fmt.Sprintf("h-%d-%d", r, i), reused).Draw(rt, "hostile")
		}
		var msgs []*message.Message
		isHostile := map[int]bool{}
		for _, v := range order {
			for len(hostile) > 0 && rapid.Bool().Draw(rt, "hostile first") {
				isHostile[len(msgs)] = true
				msgs, hostile = append(msgs, hostile[0]), hostile[1:]
			}
			msgs = append(msgs, consumertest.Message(rt, validEvents[v]))
		}
		for _, h := range hostile {
			isHostile[len(msgs)] = true
			msgs = append(msgs, h)
		}

		for i, m := range msgs {
			off := offset.Add(1)
			m.SetContext(delivery.WithSource(context.Background(), delivery.Source{Topic: "events", FromKafka: true, Offset: off}))
			before := attempts.Load()
			_, err := chain(m)
			require.NoError(rt, err, "message %d: the chain acknowledges it", i)
			if !isHostile[i] {
				continue
			}
			e, derr := eventline.Decode(m)
			var d *held.Event
			var ids []int64
			rows, err := f.env.Pool.Query(context.Background(), `SELECT id FROM `+sqlident.Qualify(f.env.Schema, "held_events")+` WHERE consumer_group = $1 AND kafka_offset = $2`, group, off)
			require.NoError(rt, err)
			ids, err = pgx.CollectRows(rows, pgx.RowTo[int64])
			require.NoError(rt, err)
			if len(ids) > 0 {
				dead, err := st.List(context.Background(), f.env.Pool, held.Filter{Group: group, IDs: ids})
				require.NoError(rt, err)
				require.Len(rt, dead, 1, "message %d: one dead letter", i)
				d = &dead[0]
			}
			var outcome *string
			if derr == nil {
				err := f.env.Pool.QueryRow(context.Background(), `SELECT outcome FROM `+sqlident.Qualify(f.env.Schema, "processed_events")+
					` WHERE consumer_group = $1 AND event_id = $2 AND aggregate_type = $3 AND aggregate_id = $4`,
					group, e.ID, e.AggregateType, e.AggregateID).Scan(&outcome)
				if err != nil {
					require.ErrorIs(rt, err, pgx.ErrNoRows)
				}
			}
			if d == nil && outcome != nil && *outcome != string(dedup.OutcomeApplied) {
				// The gate parked it (or found it stale): the handler has
				// not run, so PostgreSQL has not judged its content yet.
				require.Equal(rt, int64(0), attempts.Load()-before, "message %d (%s) never reached the handler", i, *outcome)
				continue
			}
			var p content
			refused := derr != nil || (json.Unmarshal(e.Payload, &p) == nil && (strings.ContainsRune(p.Name, 0) || (p.Ref != "" && p.Ref != validRef) ||
				p.Amount > math.MaxInt32 || p.Amount < math.MinInt32))
			if !refused {
				// It decodes and can be stored: applied, parked or refused
				// by the gate (a version beyond MaxGap), never retried.
				require.True(rt, outcome != nil || d != nil, "message %d decodes: recorded or refused", i)
				if d == nil {
					continue
				}
			}
			require.NotNil(rt, d, "message %d (%v) is dead-lettered", i, derr)
			require.NotContains(rt, []string{dedup.KindRetriesExhausted, dedup.KindFailed}, d.Cause, "message %d: the event's fault: %s", i, d.Reason)
			require.LessOrEqual(rt, attempts.Load()-before, int64(1), "message %d: at most one attempt reached the handler", i)
			require.Equal(rt, 1, d.Times)
			require.Equal(rt, nonNil(m.Payload), nonNil(d.Payload), "message %d: payload kept byte for byte", i)
			require.Equal(rt, map[string]string(m.Metadata), d.Metadata, "message %d: headers kept byte for byte", i)
		}
		var applied []int64
		for _, e := range f.env.Effects(rt, group) {
			if e.AggregateID == valid {
				applied = append(applied, e.Version)
			}
		}
		require.Equal(rt, versionsUpTo(n), applied, "the valid events, once, in order")
	})
}

// content is what the property's handler writes: Name to a text column,
// Ref (when set) to a uuid column, Amount to an integer (int4) column.
type content struct {
	Name   string `json:"name"`
	Ref    string `json:"ref,omitempty"`
	Amount int64  `json:"amount,omitempty"`
}

const validRef = "0190a7e2-6b1c-7b3e-9f00-000000000001"

func versionsUpTo(n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(i + 1)
	}
	return out
}

func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// Content the driver cannot encode for the handler's column (a number
// beyond int4, caught by pgx before PostgreSQL sees it) is the event's
// fault, as the same value refused by PostgreSQL (SQLSTATE 22003) is:
// dead-lettered at its first attempt, not after the retry budget.
func TestValueTheDriverCannotEncodeIsTheEventsFault(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{MaxRetries: 3, Retry: eventline.Backoff{Initial: time.Millisecond, Max: time.Millisecond}})
	amounts := f.env.CreateTable(t, "amounts", `event_id text NOT NULL, amount integer NOT NULL`)
	chain, attempts := f.countedChain(func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		var p struct{ Amount int64 }
		if err := json.Unmarshal(e.Payload, &p); err != nil {
			return middleware.Permanent(err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+amounts+` (event_id, amount) VALUES ($1, $2)`, e.ID, p.Amount); err != nil {
			return err
		}
		return f.env.Apply(ctx, tx, group, e)
	})
	for i, payload := range []string{`{"amount":1}`, `{"amount":4294967296}`, `{"amount":2}`} {
		e := consumertest.Event("a", []int64{1, 2, 2}[i]) // the refused v2, then a valid one
		e.Payload = []byte(payload)
		msg := consumertest.Message(t, e)
		msg.SetContext(delivery.WithSource(context.Background(), delivery.Source{Topic: "events", FromKafka: true, Offset: int64(i)}))
		before := attempts.Load()
		_, err := chain(msg)
		require.NoError(t, err)
		if i == 1 {
			require.EqualValues(t, 1, attempts.Load()-before, "one attempt: retrying cannot encode it")
		}
	}
	dead, err := held.New(f.env.Schema).List(context.Background(), f.env.Pool, held.Filter{Group: group})
	require.NoError(t, err)
	require.Len(t, dead, 1)
	require.Equal(t, dedup.KindPermanent, dead[0].Cause, dead[0].Reason)
	require.EqualValues(t, 1, dead[0].Offset)
	require.Contains(t, dead[0].Reason, "int4")
	require.Equal(t, []int64{1, 2}, f.versions(t, "a"))
}

// byteCounter counts the bytes a text handler writes.
type byteCounter struct{ n atomic.Int64 }

func (c *byteCounter) Write(p []byte) (int, error) { c.n.Add(int64(len(p))); return len(p), nil }

// A hostile record's 1 MiB fields (message UUID, event id, event type)
// are kept whole in its dead letter, but the warning that says it was
// dead-lettered stays short: a hostile record costs the log pipeline a
// line, not megabytes. Before: each field was logged in full.
func TestDeadLetterWarningOfAHugeRecordIsBounded(t *testing.T) {
	t.Parallel()
	var logged byteCounter
	f := newFixture(t, middleware.Config{Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	chain := f.el.Chain("billing", f.business(group))
	mib := strings.Repeat("x", 1<<20)
	for i, field := range []string{eventline.MetaEventID, eventline.MetaEventType, eventline.MetaAggregateID} {
		msg := consumertest.Message(t, consumertest.Event(fmt.Sprintf("a%d", i), 1))
		msg.UUID = mib
		msg.Metadata.Set(field, mib)
		msg.SetContext(delivery.WithSource(context.Background(), delivery.Source{Topic: "events", FromKafka: true, Offset: int64(i)}))
		before := logged.n.Load()
		_, err := chain(msg)
		require.NoError(t, err)
		require.Less(t, logged.n.Load()-before, int64(16<<10), "%s: the warning is bounded", field)
	}
	dead, err := held.New(f.env.Schema).List(context.Background(), f.env.Pool, held.Filter{Group: group})
	require.NoError(t, err)
	require.Len(t, dead, 3)
	for _, d := range dead {
		require.Equal(t, mib, d.MessageUUID, "the dead letter keeps the record whole")
	}
}

// A hostile record's fields reach the spans of its process and dead
// letter bounded (256 bytes) and valid UTF-8: an exporter (OTLP's
// protobuf) refuses invalid UTF-8, which would lose the spans batched
// with it. Before: a 1 MiB id with invalid UTF-8 went to the attributes
// as it was.
func TestSpansOfAHostileRecordCarryBoundedValidText(t *testing.T) {
	t.Parallel()
	f, rec := tracedFixture(t, middleware.Config{MaxRetries: middleware.NoRetries})
	f.handler = f.el.Chain("billing", f.business(group))
	hostile := strings.Repeat("\xff", 1<<20)
	msg := consumertest.Message(t, consumertest.Event("a", 1))
	for _, k := range []string{eventline.MetaEventID, eventline.MetaEventType, eventline.MetaAggregateType, eventline.MetaAggregateID} {
		msg.Metadata.Set(k, "x"+hostile)
	}
	require.NoError(t, deliverFrom(t, f, msg), "dead-lettered and acknowledged")
	spans := rec.Spans()
	require.NotEmpty(t, childrenOfAny(spans, "dead_letter "+tracedTopic), "a dead_letter span:\n%s", tracingtest.Tree(spans))
	for _, s := range spans {
		for _, a := range s.Attributes {
			v := a.Value.Emit()
			require.LessOrEqual(t, len(v), 512, "span %s, attribute %s", s.Name, a.Key)
			require.True(t, utf8.ValidString(v), "span %s, attribute %s", s.Name, a.Key)
		}
	}
}

func childrenOfAny(spans tracetest.SpanStubs, name string) tracetest.SpanStubs {
	var out tracetest.SpanStubs
	for _, s := range spans {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}
