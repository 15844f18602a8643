package middleware

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/internal/tracing"
)

// Metadata keys set on the copy of a dead letter published to
// Config.DeadLetterTopic, next to the message's own metadata. DeadLetterReasonKey,
// DeadLetterTopicKey and DeadLetterHandlerKey are Watermill's PoisonQueue
// keys, so Watermill tooling reads them too.
const (
	// DeadLetterReasonKey holds the error that dead-lettered the event.
	DeadLetterReasonKey = wmiddleware.ReasonForPoisonedKey
	// DeadLetterTopicKey holds the topic the event was consumed from.
	DeadLetterTopicKey = wmiddleware.PoisonedTopicKey
	// DeadLetterHandlerKey holds the Watermill handler name.
	DeadLetterHandlerKey = wmiddleware.PoisonedHandlerKey
	// DeadLetterKindKey holds the kind (dedup.KindPermanent…).
	DeadLetterKindKey = "eventline_dead_kind"
	// DeadLetterGroupKey holds the consumer group that gave up.
	DeadLetterGroupKey = "eventline_dead_group"
	// DeadLetterAtKey holds when, RFC 3339.
	DeadLetterAtKey = "eventline_dead_at"
	// DeadLetterIDKey holds the id of the consumer_dead_letters row.
	DeadLetterIDKey = "eventline_dead_letter_id"
)

// deadLetter takes the messages the rest of the chain gave up on off the
// partition, keeping them whole in the consumer's own database
// (consumer_dead_letters), where `eventline consumer-dlq` lists, replays
// and discards them. It takes the place of Watermill's PoisonQueue.
//
// When the chain returns an error, it:
//   - returns it, leaving the message unacknowledged (to be redelivered),
//     when the message's context has ended (shutdown), when it is an
//     infrastructure error ([IsInfrastructure]: nothing is wrong with the
//     event) or a *CompositionError;
//   - otherwise writes the message, byte for byte, with its kind and
//     reason, in its own transaction, and acknowledges it. A failed write
//     (or one the database does not answer within 30s) is retried on
//     Config.InfraBackoff's schedule until it succeeds or the context
//     ends: a message is never acknowledged without its dead letter.
//     There is no size limit and no broker that can refuse it, so a dead
//     letter can never stall its partition.
//
// The kind is the error's own when it has a DeadLetterKind() string
// method, else dedup.KindPermanent, dedup.KindRetriesExhausted or
// dedup.KindFailed. With Config.DeadLetterTopic it also publishes a copy,
// best effort, with the DeadLetter* metadata keys.
type deadLetter struct {
	db    store.DBTX
	cfg   *Config
	store *store.Store
	tr    *tracing.Tracer // nil: tracing off
}

// middleware returns the dead-letter middleware around h.
func (d *deadLetter) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		if ctx.Err() != nil || IsInfrastructure(err) || errors.Is(err, ErrUnsafeComposition) {
			return nil, err
		}
		rec := d.record(ctx, msg, err)
		id, werr := d.traceWrite(ctx, msg, rec)
		if werr != nil {
			return nil, errors.Join(err, werr)
		}
		d.cfg.Metrics.incDeadLettered(d.cfg.Group, rec.Kind)
		// The record's fields are hostile input: the dead letter keeps them
		// whole, the warning only their start.
		d.cfg.Logger.WarnContext(ctx, "eventline: message dead-lettered; list and replay it with `eventline consumer-dlq`",
			"group", d.cfg.Group, "dead_letter_id", id, "topic", rec.Topic, "message_uuid", truncate(msg.UUID, maxLoggedField),
			"event_id", truncate(rec.EventID, maxLoggedField), "event_type", truncate(rec.EventType, maxLoggedField),
			"kind", rec.Kind, "error", truncate(err.Error(), maxReasonHeader))
		d.publishCopy(ctx, msg, rec, id)
		return nil, nil
	}
}

// traceWrite is write inside a "dead_letter" span when tracing is on.
func (d *deadLetter) traceWrite(ctx context.Context, msg *message.Message, rec store.DeadLetter) (int64, error) {
	if d.tr == nil {
		return d.write(ctx, msg, rec)
	}
	sctx := ctx
	proc, ok := processSpan(ctx)
	if ok {
		proc.SetAttributes(tracing.AttrOutcome.String(tracing.OutcomeDeadLettered))
	} else {
		sctx = d.tr.Extract(ctx, msg.Metadata)
	}
	_, span := d.tr.StartDeadLetter(sctx, rec.Topic, d.cfg.Group, rec.Kind, eventFromMetadata(msg.Metadata))
	id, err := d.write(ctx, msg, rec)
	tracing.End(span, err)
	return id, err
}

// writeTimeout bounds one attempt to write a dead letter, so a connection
// that stops answering is given up on and the write retried on another.
const writeTimeout = 30 * time.Second

// write stores rec, retrying until it succeeds or ctx ends.
func (d *deadLetter) write(ctx context.Context, msg *message.Message, rec store.DeadLetter) (int64, error) {
	for attempt := 1; ; attempt++ {
		wctx, cancel := context.WithTimeout(ctx, writeTimeout)
		id, err := d.store.AddDeadLetter(wctx, d.db, rec)
		cancel()
		if err == nil {
			if attempt > 1 {
				d.cfg.Logger.InfoContext(ctx, "eventline: dead letter written after failed attempts", "group", d.cfg.Group, "attempts", attempt)
			}
			return id, nil
		}
		if ctx.Err() != nil {
			return 0, fmt.Errorf("eventline: dead letter not written before shutdown; the message stays unacknowledged: %w", err)
		}
		d.cfg.Metrics.incDeadLetterWriteFailure(d.cfg.Group)
		log := d.cfg.Logger.DebugContext
		if attempt == 1 {
			log = d.cfg.Logger.ErrorContext
		}
		log(ctx, "eventline: cannot write the dead letter; the message stays unacknowledged and the write is retried",
			"group", d.cfg.Group, "message_uuid", truncate(msg.UUID, maxLoggedField), "attempt", attempt, "error", err)
		if backoff.Sleep(ctx, backoff.Jittered(d.cfg.InfraBackoff, attempt)) != nil {
			return 0, fmt.Errorf("eventline: dead letter not written before shutdown; the message stays unacknowledged: %w", err)
		}
	}
}

// publishCopy publishes the dead letter to the dead-letter topic, best
// effort.
func (d *deadLetter) publishCopy(ctx context.Context, msg *message.Message, rec store.DeadLetter, id int64) {
	if d.cfg.DeadLetterPublisher == nil {
		return
	}
	dl := msg.Copy()
	dl.Metadata.Set(DeadLetterReasonKey, truncateReason(rec.Reason))
	dl.Metadata.Set(DeadLetterKindKey, rec.Kind)
	dl.Metadata.Set(DeadLetterTopicKey, rec.Topic)
	dl.Metadata.Set(DeadLetterHandlerKey, rec.Handler)
	dl.Metadata.Set(DeadLetterGroupKey, d.cfg.Group)
	dl.Metadata.Set(DeadLetterAtKey, time.Now().UTC().Format(time.RFC3339Nano))
	dl.Metadata.Set(DeadLetterIDKey, strconv.FormatInt(id, 10))
	if err := d.cfg.DeadLetterPublisher.Publish(d.cfg.DeadLetterTopic, dl); err != nil {
		d.cfg.Metrics.incDeadLetterPublishFailure(d.cfg.Group)
		d.cfg.Logger.WarnContext(ctx, "eventline: dead letter kept in consumer_dead_letters but not copied to the dead-letter topic",
			"group", d.cfg.Group, "dead_letter_id", id, "topic", d.cfg.DeadLetterTopic, "message_uuid", truncate(msg.UUID, maxLoggedField), "error", err)
	}
}

// maxReasonHeader bounds the reason in the Kafka copy's headers, and the
// error in the dead-letter warning.
const maxReasonHeader = 8 << 10

// maxLoggedField bounds each of the record's own fields (message UUID,
// event id, event type) in the dead-letter warning.
const maxLoggedField = 256

func truncateReason(s string) string { return truncate(s, maxReasonHeader) }

// truncate cuts s to at most n bytes, on a rune boundary, marking the cut
// with "…".
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for len(s) > 0 && !utf8.RuneStart(s[len(s)-1]) {
		s = s[:len(s)-1]
	}
	if len(s) > 0 {
		s = s[:len(s)-1]
	}
	return s + "…"
}

// record builds the dead letter of msg.
func (d *deadLetter) record(ctx context.Context, msg *message.Message, err error) store.DeadLetter {
	src := delivery.SourceOf(ctx)
	rec := store.DeadLetter{
		Group: d.cfg.Group, Topic: src.Topic, Handler: src.Handler,
		FromKafka: src.FromKafka, Partition: src.Partition, Offset: src.Offset, Key: src.Key,
		MessageUUID: msg.UUID, Payload: msg.Payload, Metadata: maps.Clone(map[string]string(msg.Metadata)),
		Kind: deadLetterKind(err), Reason: err.Error(),
	}
	if e, derr := eventline.Decode(msg); derr == nil {
		rec.EventID, rec.EventType, rec.AggregateType, rec.AggregateID, rec.AggregateVersion = e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion
	} else {
		md := msg.Metadata
		rec.EventID, rec.EventType = md.Get(eventline.MetaEventID), md.Get(eventline.MetaEventType)
		rec.AggregateType, rec.AggregateID = md.Get(eventline.MetaAggregateType), md.Get(eventline.MetaAggregateID)
		if v, perr := strconv.ParseInt(md.Get(eventline.MetaAggregateVersion), 10, 64); perr == nil && v > 0 {
			rec.AggregateVersion = v
		}
	}
	return rec
}

// deadLetterKind classifies a dead-lettering error: the error's own kind
// when it (or an error it wraps) has a DeadLetterKind() string method,
// else dedup.KindPermanent, dedup.KindRetriesExhausted or
// dedup.KindFailed.
func deadLetterKind(err error) string {
	var k interface{ DeadLetterKind() string }
	var exhausted *retriesExhaustedError
	switch {
	case errors.As(err, &k) && k.DeadLetterKind() != "":
		return k.DeadLetterKind()
	case IsPermanent(err):
		return dedup.KindPermanent
	case errors.As(err, &exhausted):
		return dedup.KindRetriesExhausted
	}
	return dedup.KindFailed
}
