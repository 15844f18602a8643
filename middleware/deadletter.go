package middleware

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/tracing"
)

// deadLetters takes the messages the rest of the chain (h) gave up on off
// the partition (see the package documentation, "Dead letters"), in the
// place of Watermill's PoisonQueue.
//
// When the chain returns an error, it:
//   - returns it, leaving the message unacknowledged (to be redelivered),
//     when the message's context has ended (shutdown), when it is an
//     infrastructure error ([IsInfrastructure]: nothing is wrong with the
//     event) or a *CompositionError;
//   - otherwise writes the message, byte for byte, with its cause and
//     reason, in its own transaction, and acknowledges it. A failed write
//     (or one the database does not answer within 30s) is retried on
//     Config.InfraBackoff's schedule until it succeeds or the context
//     ends: a message is never acknowledged without its dead letter.
//
// The cause is deadLetterKind's.
func (el *Eventline) deadLetters(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		if ctx.Err() != nil || IsInfrastructure(err) || errors.Is(err, ErrUnsafeComposition) {
			return nil, err
		}
		rec := el.deadLetterRecord(ctx, msg, err)
		id, werr := el.traceDeadLetter(ctx, msg, rec)
		if werr != nil {
			return nil, errors.Join(err, werr)
		}
		el.cfg.Metrics.add(deadLetteredCounter, 1, el.cfg.Group, rec.Cause)
		// The record's fields are hostile input: the dead letter keeps them
		// whole, the warning only their start.
		el.cfg.Logger.WarnContext(ctx, "eventline: message dead-lettered; list and replay it with `eventline held`",
			"group", el.cfg.Group, "held_event_id", id, "topic", rec.Topic, "message_uuid", held.Truncate(msg.UUID, maxLoggedField),
			"event_id", held.Truncate(rec.EventID, maxLoggedField), "event_type", held.Truncate(rec.EventType, maxLoggedField),
			"cause", rec.Cause, "error", held.Truncate(err.Error(), maxLoggedError))
		return nil, nil
	}
}

// traceDeadLetter is writeDeadLetter inside a "dead_letter" span when tracing is on.
func (el *Eventline) traceDeadLetter(ctx context.Context, msg *message.Message, rec held.Event) (int64, error) {
	if el.gate.obs.tr == nil {
		return el.writeDeadLetter(ctx, msg, rec)
	}
	sctx := ctx
	proc, ok := processSpan(ctx)
	if ok {
		proc.SetAttributes(tracing.AttrOutcome.String(tracing.OutcomeDeadLettered))
	} else {
		sctx = el.gate.obs.tr.Extract(ctx, msg.Metadata)
	}
	_, span := el.gate.obs.tr.StartDeadLetter(sctx, rec.Topic, el.cfg.Group, rec.Cause, eventFromMetadata(msg.Metadata))
	id, err := el.writeDeadLetter(ctx, msg, rec)
	tracing.End(span, err)
	return id, err
}

// writeTimeout bounds one attempt to write a dead letter, so a connection
// that stops answering is given up on and the write retried on another.
const writeTimeout = 30 * time.Second

// writeDeadLetter stores rec, retrying until it succeeds or ctx ends.
func (el *Eventline) writeDeadLetter(ctx context.Context, msg *message.Message, rec held.Event) (int64, error) {
	for attempt := 1; ; attempt++ {
		wctx, cancel := context.WithTimeout(ctx, writeTimeout)
		id, err := el.held.AddDeadLetter(wctx, el.db, rec)
		cancel()
		if err == nil {
			if attempt > 1 {
				el.cfg.Logger.InfoContext(ctx, "eventline: dead letter written after failed attempts", "group", el.cfg.Group, "attempts", attempt)
			}
			return id, nil
		}
		if ctx.Err() != nil {
			return 0, fmt.Errorf("eventline: dead letter not written before shutdown; the message stays unacknowledged: %w", err)
		}
		el.cfg.Metrics.add(deadLetterWriteFailuresCounter, 1, el.cfg.Group)
		log := el.cfg.Logger.DebugContext
		if attempt == 1 {
			log = el.cfg.Logger.ErrorContext
		}
		log(ctx, "eventline: cannot write the dead letter; the message stays unacknowledged and the write is retried",
			"group", el.cfg.Group, "message_uuid", held.Truncate(msg.UUID, maxLoggedField), "attempt", attempt, "error", err)
		if backoff.Sleep(ctx, backoff.Jittered(el.cfg.InfraBackoff, attempt)) != nil {
			return 0, fmt.Errorf("eventline: dead letter not written before shutdown; the message stays unacknowledged: %w", err)
		}
	}
}

// maxLoggedError bounds the error in the dead-letter warning.
const maxLoggedError = 8 << 10

// maxLoggedField bounds each of the record's own fields (message UUID,
// event id, event type) in the dead-letter warning.
const maxLoggedField = 256

// deadLetterRecord builds the dead letter of msg.
func (el *Eventline) deadLetterRecord(ctx context.Context, msg *message.Message, err error) held.Event {
	src := delivery.SourceOf(ctx)
	rec := held.Event{
		Group: el.cfg.Group, Topic: src.Topic, Handler: src.Handler,
		FromKafka: src.FromKafka, Partition: src.Partition, Offset: src.Offset, Key: src.Key,
		MessageUUID: msg.UUID, Payload: msg.Payload, Metadata: maps.Clone(map[string]string(msg.Metadata)),
		Cause: deadLetterKind(err), Reason: err.Error(),
	}
	if e, derr := eventline.Decode(msg); derr == nil {
		rec.EventID, rec.EventType, rec.AggregateType, rec.AggregateID, rec.AggregateVersion = e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion
		rec.PreviousVersion = e.PreviousVersion
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
