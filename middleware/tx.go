package middleware

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/store"
)

// rollbackTimeout bounds a rollback, which runs even when the message
// context has been canceled.
const rollbackTimeout = 10 * time.Second

// runInTx runs h with the open transaction tx in msg's context, commits
// when h succeeds and rolls back otherwise (also when h panics; the panic
// goes on to recoverPanics). The commit happens before runInTx returns, so
// before the router acknowledges the message: an acknowledged message
// always has its effects committed, and a crash between commit and
// acknowledgement only causes a redelivery, which the dedup record then
// recognises. The message context is restored when it returns, so no
// middleware outside sees a finished transaction.
func runInTx(msg *message.Message, tx pgx.Tx, h message.HandlerFunc) (out []*message.Message, err error) {
	orig := msg.Context()
	ctx := delivery.WithTx(orig, tx)
	done := false
	defer func() {
		msg.SetContext(orig)
		if !done {
			rollback(orig, tx)
		}
	}()
	msg.SetContext(ctx)
	out, err = h(msg)
	if err != nil {
		return nil, err
	}
	done = true
	if err := tx.Commit(orig); err != nil {
		return nil, &commitError{err: err}
	}
	delivery.RunAfterCommit(ctx)
	return out, nil
}

// rollback rolls tx back even when ctx has ended.
func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}

// recoverPanics turns a panic in h into a *panicError, so the message is
// retried like any failure instead of crashing the consumer; runInTx,
// inside it, rolls back while the panic unwinds.
func recoverPanics(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (out []*message.Message, err error) {
		defer func() {
			if r := recover(); r != nil {
				out, err = nil, &panicError{value: r, stack: debug.Stack()}
			}
		}()
		return h(msg)
	}
}

// decode decodes the message with eventline.Decode. A message that does not
// decode (no event id, a non-numeric or negative version, no aggregate…)
// is a permanent error: dead-lettered without retries.
func decode(msg *message.Message) (eventline.Event, error) {
	e, err := eventline.Decode(msg)
	if err != nil {
		return eventline.Event{}, Permanent(fmt.Errorf("message %s: %w", msg.UUID, err))
	}
	return e, nil
}

// eventOf returns the event decoded into msg's context, or decodes it.
func eventOf(msg *message.Message) (eventline.Event, error) {
	if e, ok := delivery.Event(msg.Context()); ok {
		return e, nil
	}
	return decode(msg)
}

// commitError is a failed COMMIT. When the connection died during it the
// outcome is unknown: the transaction may have committed.
type commitError struct{ err error }

func (e *commitError) Error() string {
	return "eventline: commit consumer transaction: " + e.err.Error()
}

func (e *commitError) Unwrap() error { return e.err }

// outcome is how one attempt at a batch transaction ended.
type outcome int

const (
	// committed: every member applied, one COMMIT.
	committed outcome = iota
	// cut: member at changes what a later member of its aggregate would be
	// admitted as; nothing committed. Apply items[:at], then items[at:].
	cut
	// failed: member at failed (its gate step or handler); nothing
	// committed. Apply items[:at], answer items[at] with err, then go on
	// with items[at+1:].
	failed
	// unavailable: BEGIN, the admissions or COMMIT failed: the database,
	// not a member. Run every member on its own, one after the other.
	unavailable
)

type attempt struct {
	outcome outcome
	at      int
	err     error
	outs    [][]*message.Message
}

// runBatch applies items (the arrivals of one batch, in order) and answers
// every one of them. An arrival answered with an error or told to run on
// its own is waited for (until its message has left the chain) before
// anything after it is answered, so a lane's events are applied in order
// even then. It returns false when ctx ended: every arrival not answered
// yet has been told to run on its own.
func (el *Eventline) runBatch(ctx context.Context, b *delivery.Batch, items []*delivery.Arrival) bool {
	for len(items) > 0 {
		r := el.tryBatch(ctx, items)
		switch r.outcome {
		case committed:
			for i, it := range items {
				it.Answer(delivery.Reply{Out: r.outs[i]})
			}
			return true
		case cut, failed:
			if !el.runBatch(ctx, b, items[:r.at]) {
				return delivery.Abandon(items[r.at:])
			}
			items = items[r.at:]
			if r.outcome == failed {
				it := items[0]
				it.Answer(delivery.Reply{Err: r.err})
				items = items[1:]
				if !it.WaitLeft(ctx) {
					return delivery.Abandon(items)
				}
			}
		case unavailable:
			el.cfg.Logger.DebugContext(ctx, "eventline: batch transaction failed; applying its events one by one", "group", el.gate.cfg.Group, "events", len(items), "error", r.err)
			return b.OneByOne(ctx, items)
		}
	}
	return true
}

// tryBatch runs items in one transaction. It never answers an arrival.
func (el *Eventline) tryBatch(ctx context.Context, items []*delivery.Arrival) attempt {
	// The transaction's own statements stop when the batch is abandoned or
	// any member's context ends.
	// With a TxTimeout, the batch's transaction gets one per member.
	bctx, cancel := context.WithCancel(ctx)
	if el.cfg.TxTimeout > 0 {
		bctx, cancel = context.WithTimeout(ctx, el.cfg.TxTimeout*time.Duration(len(items)))
	}
	defer cancel()
	for _, it := range items {
		stop := context.AfterFunc(it.Msg.Context(), cancel)
		defer stop()
	}

	tx, admissions, failure := el.admitBatch(ctx, bctx, items)
	if failure != nil {
		return *failure
	}
	if at := cutAt(items, admissions); at > 0 {
		rollback(ctx, tx)
		return attempt{outcome: cut, at: at}
	}

	outs := make([][]*message.Message, len(items))
	ctxs := make([]context.Context, len(items))
	for i, it := range items {
		out, ictx, err := el.proceedInBatch(bctx, it, tx, admissions[i])
		if err != nil {
			// Classified as on the one-event path: the handler's fault (or
			// the event's) is the member's alone; the database's, or a
			// conflict with another transaction, is nobody's: then every
			// member runs on its own.
			// When the batch's own context ended (its deadline, another
			// member's context, the batch abandoned), the member that was
			// running is not to blame either: alone, each finds out.
			lost := tx.Conn() != nil && tx.Conn().IsClosed() // before the rollback hands it back
			rollback(ctx, tx)
			err = el.classify(it.Msg.Context(), ictx, stageHandler, lost, err)
			if bctx.Err() != nil || IsInfrastructure(err) || IsConflict(err) {
				return attempt{outcome: unavailable, err: err}
			}
			return attempt{outcome: failed, at: i, err: err}
		}
		outs[i], ctxs[i] = out, ictx
	}
	if err := tx.Commit(bctx); err != nil {
		rollback(ctx, tx)
		return attempt{outcome: unavailable, err: fmt.Errorf("eventline: commit batch transaction: %w", err)}
	}
	for _, ictx := range ctxs {
		delivery.RunAfterCommit(ictx)
	}
	return attempt{outcome: committed, outs: outs}
}

// admitBatch begins the batch's transaction and admits its members, in
// one round trip: in one statement when the batch has the shape for it
// (see store.QueueAdmitBatch) and none of its members was recorded before,
// else one statement per member, in lock order (again, after a rollback,
// when a member turned out to be recorded: those statements tell a
// duplicate from an id conflict). On failure it returns the attempt, the
// transaction rolled back.
func (el *Eventline) admitBatch(ctx, bctx context.Context, items []*delivery.Arrival) (pgx.Tx, []store.Admission, *attempt) {
	g := el.gate
	events := make([]eventline.Event, len(items))
	jumps := make([]bool, len(items))
	for i, it := range items {
		events[i], jumps[i] = it.Event, g.jumps(it.Event)
	}
	order := store.AdmissionOrder(events)
	whole := len(items) > 1
	for {
		pb := &pgx.Batch{}
		pb.BeginTx(el.cfg.TxOptions)
		var batch *store.PendingBatch
		if whole {
			batch = g.store.QueueAdmitBatch(pb, g.cfg.Group, events, jumps, order)
		}
		var results []admissionResult
		if batch == nil {
			results = make([]admissionResult, len(items))
			for _, i := range order {
				results[i] = g.queueAdmission(pb, events[i])
			}
		}
		tx, err := el.sendBegin(ctx, bctx, pb, "batch")
		if err != nil {
			return nil, nil, &attempt{outcome: unavailable, err: err}
		}
		if batch != nil {
			admissions, err := batch.Result()
			switch {
			case errors.Is(err, store.ErrBatchRecorded):
				rollback(ctx, tx)
				whole = false
				continue
			case err != nil:
				rollback(ctx, tx)
				return nil, nil, &attempt{outcome: unavailable, err: err}
			}
			return tx, admissions, nil
		}
		admissions := make([]store.Admission, len(items))
		for i, res := range results {
			if admissions[i], err = res(bctx, tx); err != nil {
				rollback(ctx, tx)
				if errors.Is(err, dedup.ErrIDConflict) {
					// The member's own fault: refused, like on its own.
					return nil, nil, &attempt{outcome: failed, at: i, err: g.admissionError(items[i].Msg.Context(), items[i].Event, err)}
				}
				return nil, nil, &attempt{outcome: unavailable, err: err}
			}
		}
		return tx, admissions, nil
	}
}

// proceedInBatch runs the gate's decision and the handler for one member
// in the batch's transaction, with the member's own context (its
// after-commit hooks are its own; it ends when the batch's does), behind
// recoverPanics. It returns the context the hooks were registered on
// (canceled by then: only its values are used afterwards).
func (el *Eventline) proceedInBatch(bctx context.Context, it *delivery.Arrival, tx pgx.Tx, a store.Admission) ([]*message.Message, context.Context, error) {
	orig := it.Msg.Context()
	// The member's context, ended with the batch's (its deadline too).
	var mctx context.Context
	var cancel context.CancelFunc
	if d, ok := bctx.Deadline(); ok {
		mctx, cancel = context.WithDeadline(orig, d)
	} else {
		mctx, cancel = context.WithCancel(orig)
	}
	stop := context.AfterFunc(bctx, cancel)
	ictx := delivery.WithTx(mctx, tx)
	it.Msg.SetContext(ictx)
	defer func() {
		stop()
		cancel()
		it.Msg.SetContext(orig)
	}()
	out, err := recoverPanics(func(msg *message.Message) ([]*message.Message, error) {
		return el.gate.proceed(msg, tx, it.Event, it.Handler, a)
	})(it.Msg)
	return out, ictx, err
}

// cutAt returns the first member whose admission, made before the members
// ahead of it ran, may differ from what it would have been after them: an
// earlier member of the same aggregate was not "quiet" (it will park, or
// drain parked successors, or anything else than applying with nothing
// parked or being a duplicate). 0 means no cut.
func cutAt(items []*delivery.Arrival, admissions []store.Admission) int {
	type key struct{ typ, id string }
	quiet := map[key]bool{}
	for i, it := range items {
		if it.Event.AggregateVersion <= 0 {
			continue // unversioned: no aggregate row involved
		}
		k := key{it.Event.AggregateType, it.Event.AggregateID}
		q, seen := quiet[k]
		if seen && !q {
			return i
		}
		a := admissions[i]
		quiet[k] = (!seen || q) && (a.Verdict == store.Duplicate || (a.Verdict == store.Next && a.Parked == 0))
	}
	return 0
}
