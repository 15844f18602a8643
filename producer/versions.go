package producer

import (
	"context"
	"errors"
	"fmt"
	"sort"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/sqlident"
)

// ErrVersionConflict is matched by *VersionConflictError.
var ErrVersionConflict = errors.New("eventline: aggregate version conflict")

// VersionConflictError reports a supplied aggregate version that is not
// greater than the aggregate's last published version. The transaction that
// got it is still usable.
type VersionConflictError struct {
	AggregateType string
	AggregateID   string
	// Version is the version the caller supplied.
	Version int64
	// Current is the aggregate's last published version.
	Current int64
}

func (e *VersionConflictError) Error() string {
	return fmt.Sprintf("eventline: aggregate %s/%s: version %d is not greater than the last published version %d; reload the aggregate and retry",
		e.AggregateType, e.AggregateID, e.Version, e.Current)
}

// Unwrap lets errors.Is(err, ErrVersionConflict) match.
func (e *VersionConflictError) Unwrap() error { return ErrVersionConflict }

type aggregateKey struct{ typ, id string }

type producerSQL struct {
	// allocate adds n to each aggregate's sequence (creating it at n) and
	// returns the new last version. Rows are locked in key order, so
	// concurrent batches cannot deadlock on each other.
	allocate string
	// advance sets the sequence to $3 if it is below $4, the lowest
	// supplied version; it returns no row when it is not.
	advance string
	current string
}

func newProducerSQL(schema string) producerSQL {
	seq := sqlident.Qualify(schema, "aggregate_sequences")
	return producerSQL{
		allocate: `INSERT INTO ` + seq + ` AS s (aggregate_type, aggregate_id, version)
			SELECT t, i, n FROM unnest($1::text[], $2::text[], $3::bigint[]) AS u(t, i, n) ORDER BY t, i
			ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET version = s.version + excluded.version
			RETURNING aggregate_type, aggregate_id, version`,
		advance: `INSERT INTO ` + seq + ` AS s (aggregate_type, aggregate_id, version) VALUES ($1, $2, $3)
			ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET version = excluded.version
			WHERE s.version < $4
			RETURNING version`,
		current: `SELECT version FROM ` + seq + ` WHERE aggregate_type = $1 AND aggregate_id = $2`,
	}
}

// assignVersions fills in every zero AggregateVersion and records supplied
// ones, in tx. An aggregate whose events in this call all lack a version
// costs nothing extra: all such aggregates share one statement.
func (p *Producer) assignVersions(ctx context.Context, tx pgx.Tx, events []eventline.Event) error {
	groups := map[aggregateKey][]int{}
	var keys []aggregateKey
	for i, e := range events {
		k := aggregateKey{e.AggregateType, e.AggregateID}
		if _, ok := groups[k]; !ok {
			keys = append(keys, k)
		}
		groups[k] = append(groups[k], i)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].typ != keys[j].typ {
			return keys[i].typ < keys[j].typ
		}
		return keys[i].id < keys[j].id
	})

	var autoTypes, autoIDs []string
	var autoCounts []int64
	for _, k := range keys {
		if allAuto(events, groups[k]) {
			autoTypes = append(autoTypes, k.typ)
			autoIDs = append(autoIDs, k.id)
			autoCounts = append(autoCounts, int64(len(groups[k])))
			continue
		}
		if err := p.assignMixed(ctx, tx, k, events, groups[k]); err != nil {
			return err
		}
	}
	if len(autoTypes) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, p.sql.allocate, autoTypes, autoIDs, autoCounts)
	if err != nil {
		return fmt.Errorf("allocate aggregate versions: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var k aggregateKey
		var last int64
		if err := rows.Scan(&k.typ, &k.id, &last); err != nil {
			return fmt.Errorf("allocate aggregate versions: %w", err)
		}
		idx := groups[k]
		for j, i := range idx {
			events[i].AggregateVersion = last - int64(len(idx)-1-j)
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("allocate aggregate versions: %w", err)
	}
	return nil
}

func allAuto(events []eventline.Event, idx []int) bool {
	for _, i := range idx {
		if events[i].AggregateVersion != 0 {
			return false
		}
	}
	return true
}

// assignMixed handles an aggregate with at least one supplied version: it
// walks the events in order, allocating after the last supplied version.
func (p *Producer) assignMixed(ctx context.Context, tx pgx.Tx, k aggregateKey, events []eventline.Event, idx []int) error {
	for start := 0; start < len(idx); {
		e := &events[idx[start]]
		if e.AggregateVersion == 0 {
			// A run of events without versions: allocate them together.
			end := start
			for end < len(idx) && events[idx[end]].AggregateVersion == 0 {
				end++
			}
			var typ, id string
			var last int64
			err := tx.QueryRow(ctx, p.sql.allocate, []string{k.typ}, []string{k.id}, []int64{int64(end - start)}).Scan(&typ, &id, &last)
			if err != nil {
				return fmt.Errorf("allocate aggregate versions: %w", err)
			}
			for j := start; j < end; j++ {
				events[idx[j]].AggregateVersion = last - int64(end-1-j)
			}
			start = end
			continue
		}
		var v int64
		err := tx.QueryRow(ctx, p.sql.advance, k.typ, k.id, e.AggregateVersion, e.AggregateVersion).Scan(&v)
		if errors.Is(err, pgx.ErrNoRows) {
			var current int64
			if err := tx.QueryRow(ctx, p.sql.current, k.typ, k.id).Scan(&current); err != nil {
				return fmt.Errorf("read aggregate version: %w", err)
			}
			return &VersionConflictError{AggregateType: k.typ, AggregateID: k.id, Version: e.AggregateVersion, Current: current}
		}
		if err != nil {
			return fmt.Errorf("record aggregate version: %w", err)
		}
		start++
	}
	return nil
}
