package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/store"
)

// replayBatch bounds the dead letters one replay pass claims.
const replayBatch = 100

// replayStatementTimeout bounds each statement of a replay pass's claim
// transaction (the replays themselves are bounded by Config.TxTimeout).
const replayStatementTimeout = 30 * time.Second

// replayResult reports one replay pass.
type replayResult struct {
	// Replayed counts dead letters that went through their handler and
	// committed (applied, parked, a duplicate, or held again as late or as
	// a version conflict, see gate.conflict).
	Replayed int
	// Failed counts dead letters whose replay failed, or that were held
	// back because an earlier dead letter of their aggregate failed; they
	// are held again, with the error (HeldEvent.LastError).
	Failed int
}

// replayDeadLetters makes one pass over the group's dead letters whose
// replay was requested (`eventline held replay`, admin.ReplayHeld). It
// claims them (rows another replayer holds are skipped) and runs each, in
// order (per aggregate by version, then as the records arrived), through
// the eventline middleware and the handler registered under the dead
// letter's handler name, once, without retries. A replay that commits marks its dead letter replayed;
// one that fails holds it again with the error, and holds back the
// aggregate's later dead letters in the pass. A dead letter is not
// replayed while an earlier one of its aggregate is still held (not asked
// to replay): it is held again, saying which one to replay or discard
// first. So an aggregate's dead letters are never applied out of order.
// One whose version its aggregate passed meanwhile is held as a version
// conflict (see gate.conflict), never discarded as stale. An
// infrastructure error ends the pass; what was not replayed stays
// requested for the next one.
//
// [Eventline.Run] calls it every SweepInterval.
func (el *Eventline) replayDeadLetters(ctx context.Context) (res replayResult, err error) {
	defer func() {
		if err != nil {
			err = fmt.Errorf("eventline: replay dead letters of %q: %w", el.cfg.Group, err)
		}
	}()
	dls := el.held
	// Each statement of the claim transaction is bounded, so a database
	// that stops answering ends the pass instead of hanging it.
	bounded := func(f func(ctx context.Context) error) error {
		sctx, cancel := context.WithTimeout(ctx, replayStatementTimeout)
		defer cancel()
		return f(sctx)
	}
	var tx pgx.Tx
	if err := bounded(func(ctx context.Context) (err error) { tx, err = el.db.Begin(ctx); return err }); err != nil {
		return res, err
	}
	defer rollback(ctx, tx)
	var claimed []held.Event
	if err := bounded(func(ctx context.Context) (err error) {
		claimed, err = dls.Claim(ctx, tx, el.cfg.Group, held.KindDeadLetter, replayBatch)
		return err
	}); err != nil {
		return res, err
	}
	fail := func(id int64, why string) error {
		res.Failed++
		el.cfg.Metrics.add(replaysCounter, 1, el.cfg.Group, "failed")
		return bounded(func(ctx context.Context) error { return dls.MarkReplayFailed(ctx, tx, id, why, 0, true) })
	}
	var stop error
	failed := map[store.Key]int64{}
	for _, d := range claimed {
		k := store.Key{Group: d.Group, AggregateType: d.AggregateType, AggregateID: d.AggregateID}
		if k.AggregateID == "" {
			k.AggregateID = fmt.Sprintf("dead letter %d", d.ID) // unrelated to any other
		}
		if first, ok := failed[k]; ok {
			if err := fail(d.ID, fmt.Sprintf("not replayed: dead letter %d of the same aggregate failed to replay first", first)); err != nil {
				return res, err
			}
			continue
		}
		var earlier, version int64
		var found bool
		if err := bounded(func(ctx context.Context) (err error) {
			earlier, version, found, err = dls.EarlierHeld(ctx, tx, d)
			return err
		}); err != nil {
			return res, err
		}
		if found {
			failed[k] = earlier
			why := fmt.Sprintf("not replayed: dead letter %d (version %d) of the same aggregate is still held; replay it too, or discard it, first", earlier, version)
			if err := fail(d.ID, why); err != nil {
				return res, err
			}
			continue
		}
		rerr := el.replay(ctx, d)
		if rerr == nil {
			if err := bounded(func(ctx context.Context) error { return dls.MarkReplayed(ctx, tx, d.ID) }); err != nil {
				return res, err
			}
			res.Replayed++
			el.cfg.Metrics.add(replaysCounter, 1, el.cfg.Group, "replayed")
			continue
		}
		if ctx.Err() != nil || IsInfrastructure(rerr) {
			stop = rerr // keep what was marked; the rest stays requested
			break
		}
		failed[k] = d.ID
		el.cfg.Logger.WarnContext(ctx, "eventline: replay of a dead letter failed; it is held again",
			"group", el.cfg.Group, "held_event_id", d.ID, "event_id", d.EventID, "error", rerr)
		if err := fail(d.ID, rerr.Error()); err != nil {
			return res, err
		}
	}
	if err := bounded(func(ctx context.Context) error { return tx.Commit(ctx) }); err != nil {
		return res, err
	}
	return res, stop
}

// replay runs one dead letter through the eventline middleware and its
// handler.
func (el *Eventline) replay(ctx context.Context, d held.Event) error {
	h, err := el.gate.handler(d.Handler)
	if err != nil {
		return err
	}
	msg := d.Message()
	ctx = context.WithValue(ctx, replayKey{}, true)
	msg.SetContext(delivery.WithSource(ctx, delivery.Source{Handler: d.Handler, Topic: d.Topic, FromKafka: d.FromKafka, Partition: d.Partition, Offset: d.Offset, Key: d.Key}))
	_, err = el.handler(el.guard(h))(msg)
	return err
}

// replayKey marks the context of a dead letter's replay.
type replayKey struct{}

// isReplay reports whether ctx is a dead letter's replay: the gate then
// holds a stale verdict as a version conflict (see Gate.conflict).
func isReplay(ctx context.Context) bool {
	r, _ := ctx.Value(replayKey{}).(bool)
	return r
}

// runReplays replays requested dead letters every SweepInterval until ctx
// ends.
func (el *Eventline) runReplays(ctx context.Context) {
	t := time.NewTicker(el.cfg.SweepInterval)
	defer t.Stop()
	down := false // the database was unavailable on the last pass
	for {
		res, err := el.replayDeadLetters(ctx)
		switch {
		case ctx.Err() != nil:
			return
		case err != nil && IsInfrastructure(err):
			// The consumer's Retry already reports the outage; say it once.
			log := el.cfg.Logger.DebugContext
			if !down {
				log = el.cfg.Logger.WarnContext
			}
			down = true
			log(ctx, "eventline: cannot replay dead letters while the database is unavailable; retrying on the next tick", "group", el.cfg.Group, "error", err)
		case err != nil && !errors.Is(err, context.Canceled):
			down = false
			el.cfg.Logger.ErrorContext(ctx, "eventline: replay of dead letters failed; retrying on the next tick", "group", el.cfg.Group, "error", err)
		default:
			down = false
			if res.Replayed > 0 || res.Failed > 0 {
				el.cfg.Logger.InfoContext(ctx, "eventline: dead letters replayed", "group", el.cfg.Group, "replayed", res.Replayed, "failed", res.Failed)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
