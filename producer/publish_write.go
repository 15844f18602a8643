package producer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/eventline/eventline"
)

// aggResult is what the publish statement says about one aggregate.
type aggResult struct {
	status   int
	old      int64 // last version as read before locking; 0 when the aggregate had none
	present  bool  // whether the aggregate had a sequence row then
	curTopic string
	version  int64 // the new last version; 0 when not advanced
}

// write writes pl in tx, in one round trip, and fills in the events'
// versions. A call that queueShort covers takes its statement; a call with
// supplied versions, or one whose short statement wrote nothing because an
// aggregate's row records another topic or none (its first publish since
// topics are recorded), takes publishSQL. write returns a conflict error
// when the call conflicts, with nothing written.
func (p *Producer) write(ctx context.Context, tx pgx.Tx, pl *plan) error {
	if n := pl.callerAggs(); n > 0 && n < len(pl.aggs) {
		// The statement that may answer a conflict, writing nothing, goes
		// first.
		rest := pl.subset(false)
		if err := p.write(ctx, tx, rest); err != nil {
			return err
		}
		for j, i := range rest.orig {
			pl.events[i] = rest.events[j]
		}
		return p.write(ctx, tx, pl.subset(true))
	}
	b := &pgx.Batch{}
	var res []aggResult
	var written bool
	if p.queueShort(b, pl, false, &res, &written) {
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return fmt.Errorf("write events to the outbox: %w", err)
		}
		if written {
			if res != nil {
				pl.fill(res)
			}
			return nil
		}
		// Nothing written: undo the aggregates the statement advanced.
		if err := p.undo(ctx, tx, pl, res); err != nil {
			return err
		}
	}
	args := pl.args(p.cfg.AllowVersionGaps)
	query := p.stmts.get(stmtPublish, pl.shards)
	for attempt := 1; ; attempt++ {
		res, err := pl.run(ctx, tx, query, args)
		if err != nil {
			return err
		}
		if err := pl.conflict(res); err != nil {
			return err
		}
		if !slices.ContainsFunc(res, func(r aggResult) bool { return r.version == 0 }) { // not stale
			pl.fill(res)
			return nil
		}
		if err := p.undo(ctx, tx, pl, res); err != nil {
			return err
		}
		if attempt == maxPublishAttempts {
			return fmt.Errorf("eventline: publish: aggregate sequences kept changing under the call (%d attempts); retry the transaction", attempt)
		}
		p.cfg.Logger.DebugContext(ctx, "publish raced another writer of an aggregate; running it again", "attempt", attempt)
	}
}

// queueShort queues on b the one statement that writes pl, when pl needs no
// other, and reports whether it did: every version is the caller's (the
// rows alone, publishRowSQL or publishRowsSQL), or no version is supplied
// (publishOneSQL for one event, else publishAutoSQL; with commit set their
// PublishAndCommit variants, which fail instead of writing nothing). Once
// the statement ran, written says whether it wrote the events, and res
// holds the aggregates it advanced (nil for the caller's versions, which
// need no filling in).
func (p *Producer) queueShort(b *pgx.Batch, pl *plan, commit bool, res *[]aggResult, written *bool) bool {
	switch {
	case pl.callerAggs() == len(pl.aggs):
		query, args := p.callerVersionedStatement(pl)
		b.Queue(query, args...).Exec(func(pgconn.CommandTag) error { *written = true; return nil })
	case len(pl.events) == 1 && pl.aggs[0].firstSupplied == 0:
		st := stmtOne
		if commit {
			st = stmtOneCommit
		}
		a := &pl.aggs[0]
		b.Queue(p.stmts.get(st, pl.shards), a.typ, a.id, a.topic, pl.evHead[0]+pl.evMid[0], pl.evTail[0]).QueryRow(func(row pgx.Row) error {
			var version int64
			err := row.Scan(&version)
			*res, *written = []aggResult{{version: version}}, err == nil
			if errors.Is(err, pgx.ErrNoRows) {
				return nil // not advanced, nothing written
			}
			return err
		})
	case pl.auto():
		st := stmtAuto
		if commit {
			st = stmtAutoCommit
		}
		b.Queue(p.stmts.get(st, pl.shards), pl.autoArgs()...).QueryRow(func(row pgx.Row) error {
			var types, ids []*string
			var versions []int64
			if err := row.Scan(&types, &ids, &versions, written); err != nil {
				return err
			}
			*res = make([]aggResult, len(pl.aggs))
			pl.advanced(*res, types, ids, versions)
			return nil
		})
	default:
		return false
	}
	return true
}

// callerVersionedStatement returns the statement writing pl's rows, whose
// versions are all known, and its arguments: the payloads are complete.
func (p *Producer) callerVersionedStatement(pl *plan) (string, []any) {
	if len(pl.events) == 1 {
		return p.stmts.get(stmtRow, pl.shards), []any{pl.body(0)}
	}
	bodies := make([]string, len(pl.events))
	for i := range bodies {
		bodies[i] = pl.body(i)
	}
	return p.stmts.get(stmtRows, pl.shards), []any{pl.evShard, bodies}
}

// run executes the publish statement and reads its one row.
func (pl *plan) run(ctx context.Context, tx pgx.Tx, query string, args []any) ([]aggResult, error) {
	var statuses []int32
	var olds []*int64
	var topics, advTypes, advIDs []*string
	var advVersions []int64
	err := tx.QueryRow(ctx, query, args...).Scan(&statuses, &olds, &topics, &advTypes, &advIDs, &advVersions)
	if err != nil {
		return nil, fmt.Errorf("write events to the outbox: %w", err)
	}
	if len(statuses) != len(pl.aggs) || len(olds) != len(pl.aggs) || len(topics) != len(pl.aggs) || len(advVersions) > len(pl.aggs) {
		return nil, fmt.Errorf("write events to the outbox: unexpected result for %d aggregates", len(pl.aggs)) // unreachable
	}
	res := make([]aggResult, len(pl.aggs))
	for k := range res {
		r := &res[k]
		r.status = int(statuses[k])
		if olds[k] != nil {
			r.old, r.present = *olds[k], true
		}
		if topics[k] != nil {
			r.curTopic = *topics[k]
		}
	}
	pl.advanced(res, advTypes, advIDs, advVersions)
	return res, nil
}

// advanced sets the new version of each aggregate a publish statement
// advanced, given as its (type, id, version) arrays; the others keep 0.
func (pl *plan) advanced(res []aggResult, types, ids []*string, versions []int64) {
	index := make(map[aggregateKey]int, len(pl.aggs))
	for k, a := range pl.aggs {
		index[aggregateKey{a.typ, a.id}] = k
	}
	for j, v := range versions {
		if types[j] == nil || ids[j] == nil {
			continue
		}
		if k, ok := index[aggregateKey{*types[j], *ids[j]}]; ok {
			res[k].version = v
		}
	}
}

// undo reverts the sequence changes of a statement that wrote no events
// (see undoSQL): publishSQL's when the call was stale, publishAutoSQL's
// when an aggregate's row records another topic or none. An aggregate it
// created is deleted, one it advanced gets back the version it had and the
// topic chk read. (When chk read no topic, one may have been recorded by
// another transaction meanwhile; it is cleared again and recorded anew by
// the next publish.)
func (p *Producer) undo(ctx context.Context, tx pgx.Tx, pl *plan, res []aggResult) error {
	var types, ids []string
	var versions []int64
	var topics []*string
	for k, r := range res {
		if r.version == 0 {
			continue
		}
		a := &pl.aggs[k]
		var v int64 // 0: created by the statement, delete it
		switch {
		case a.firstSupplied != 0 && r.present:
			v = r.old
		case a.firstSupplied == 0 && (r.present || r.version != a.n):
			v = r.version - a.n
		}
		var topic *string
		switch {
		case r.curTopic != "":
			topic = &r.curTopic
		case !r.present && v != 0:
			// Created by another transaction, with this topic (the row
			// was advanced, so its topic was this one), after chk read.
			topic = &a.topic
		}
		types, ids, versions, topics = append(types, a.typ), append(ids, a.id), append(versions, v), append(topics, topic)
	}
	if len(types) == 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, p.stmts.undo, types, ids, versions, topics); err != nil {
		return fmt.Errorf("undo a partial outbox write; roll back the transaction: %w", err)
	}
	return nil
}

// auto reports whether no event of the call has a supplied version.
func (pl *plan) auto() bool {
	for _, a := range pl.aggs {
		if a.firstSupplied != 0 {
			return false
		}
	}
	return true
}

// args are the publish statement's parameters.
func (pl *plan) args(allowGaps bool) []any {
	n := len(pl.aggs)
	types, ids, topics := make([]string, n), make([]string, n), make([]string, n)
	counts, leads, firsts, lasts := make([]int64, n), make([]int64, n), make([]int64, n), make([]int64, n)
	for i, a := range pl.aggs {
		types[i], ids[i], topics[i] = a.typ, a.id, a.topic
		counts[i], leads[i], firsts[i] = a.n, a.lead, a.firstSupplied
		if a.firstSupplied != 0 {
			lasts[i] = a.last
		}
	}
	return []any{types, ids, counts, leads, firsts, lasts, topics, allowGaps,
		pl.evAgg, pl.evRel, pl.evVer, pl.evPrev, pl.evShard, pl.evHead, pl.evMid, pl.evTail}
}

// autoArgs are the parameters of publishAutoSQL and publishAutoCommitSQL.
func (pl *plan) autoArgs() []any {
	n := len(pl.aggs)
	types, ids, topics, counts := make([]string, n), make([]string, n), make([]string, n), make([]int64, n)
	for i, a := range pl.aggs {
		types[i], ids[i], topics[i], counts[i] = a.typ, a.id, a.topic, a.n
	}
	heads := make([]string, len(pl.events))
	for i := range heads {
		heads[i] = pl.evHead[i] + pl.evMid[i]
	}
	return []any{types, ids, counts, topics, pl.evAgg, pl.evRel, pl.evShard, heads, pl.evTail}
}

// conflict returns the error for the conflicting event that comes first in
// the call (for a topic, an aggregate's first event; for a version, its
// first event with a supplied version), or nil.
func (pl *plan) conflict(res []aggResult) error {
	first, index := -1, 0
	for ai, r := range res {
		if r.status == statusOK {
			continue
		}
		a := &pl.aggs[ai]
		i := a.events[0]
		if r.status != statusTopic {
			i = a.events[a.lead]
		}
		if first < 0 || i < index {
			first, index = ai, i
		}
	}
	if first < 0 {
		return nil
	}
	a, r := &pl.aggs[first], res[first]
	var err error
	switch r.status {
	case statusTopic:
		err = &TopicConflictError{AggregateType: a.typ, AggregateID: a.id, Topic: r.curTopic, Requested: a.topic}
	case statusStale:
		err = &VersionConflictError{AggregateType: a.typ, AggregateID: a.id, Version: a.firstSupplied, Current: r.old, Next: a.next(r.old)}
	case statusGap:
		err = &VersionGapError{AggregateType: a.typ, AggregateID: a.id, Version: a.firstSupplied, Next: a.next(r.old)}
	default:
		err = errors.New("eventline: unknown publish status " + strconv.Itoa(r.status))
	}
	return fmt.Errorf("event %d: %w", pl.index(index), err)
}

// fill sets every event's version and previous version from the
// statement's result, by the same rule the statement used.
func (pl *plan) fill(res []aggResult) {
	for ai, a := range pl.aggs {
		// The version the aggregate's events in this call start after.
		base := res[ai].old
		if a.firstSupplied == 0 {
			base = res[ai].version - a.n
		}
		for _, i := range a.events {
			e := &pl.events[i]
			if pl.evVer[i] > 0 {
				e.AggregateVersion = pl.evVer[i]
			} else {
				e.AggregateVersion = base + pl.evRel[i]
			}
			if pl.evPrev[i] >= 0 {
				e.PreviousVersion = pl.evPrev[i]
			} else {
				e.PreviousVersion = base + pl.evRel[i] - 1
			}
			if e.PreviousVersion == 0 && e.AggregateVersion > 1 {
				// The record says it follows version 0.
				e.PreviousVersion = eventline.NoPreviousVersion
			}
		}
	}
}
