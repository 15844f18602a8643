package verify

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
)

// groupState is one group being checked.
type groupState struct {
	rep    *GroupReport
	topics map[string]bool
	// dedup is false for a group that keeps versions but no dedup
	// records: its unrecorded events prove nothing.
	dedup bool
	// orderFromEffects is set when the group's effects query orders its
	// effects: the order check uses it instead of processed_events.
	orderFromEffects bool
}

// runner is one Run.
type runner struct {
	cfg Config
	// rep is the report being written; its Since and Until, nil when
	// unbounded, are the window's SQL parameters.
	rep     *Report
	details *details
	groups  map[string]*groupState
	store   *store.Store
	// kafka is nil when Kafka is not read.
	kafka *kafkaIndex
	// outboxNow and consumerNow are the databases' clocks when the
	// snapshots were taken; ages are measured against them.
	outboxNow, consumerNow time.Time
	separate               bool
}

// Run checks the pipeline's guarantees against its data and returns what it
// found; see the package documentation for what is checked, and how.
//
// db (a *pgxpool.Pool or *pgx.Conn) holds the outbox and the relay's dead
// letters. consumerDB holds the consumer tables; nil means they are in db
// (the default single-database setup). Run returns an error when it
// cannot read what it needs; what it found is in the Report (Report.OK).
func Run(ctx context.Context, db, consumerDB admin.Beginner, cfg Config) (*Report, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if outbox.NilHandle(db) {
		return nil, fmt.Errorf("verify.Run: the outbox database is nil")
	}
	st, err := store.New(cfg.ConsumerSchema)
	if err != nil {
		return nil, err
	}
	r := &runner{
		cfg: cfg, details: newDetails(cfg.MaxDetails),
		groups: map[string]*groupState{}, store: st, separate: !outbox.NilHandle(consumerDB),
	}
	if !r.separate {
		consumerDB = db
	}
	r.rep = &Report{Schema: cfg.Schema, ConsumerSchema: cfg.ConsumerSchema, SeparateConsumerDatabase: r.separate}
	if !cfg.Since.IsZero() {
		r.rep.Since = &cfg.Since
	}
	if !cfg.Until.IsZero() {
		r.rep.Until = &cfg.Until
	}

	var kr *kafkaReader
	if len(cfg.Brokers) > 0 {
		if kr, err = newKafkaReader(cfg); err != nil {
			return nil, err
		}
		defer kr.close()
		r.kafka = newKafkaIndex()
	} else {
		r.note("Kafka: not read (no brokers given), so relayed events are not traced to Kafka or to the groups' Kafka offsets")
	}

	// The groups' Kafka offsets are read before the snapshots (see the
	// package documentation: How, and at what cost).
	groups, err := r.listGroups(ctx, consumerDB)
	if err != nil {
		return nil, err
	}
	if kr != nil && len(groups) > 0 {
		if r.kafka.committed, err = kr.groupOffsets(groups); err != nil {
			return nil, err
		}
	}

	ctx2 := context.WithoutCancel(ctx)
	ctx1, err := snapshot(ctx, consumerDB, "consumer", &r.consumerNow)
	if err != nil {
		return nil, err
	}
	defer func() { _ = ctx1.Rollback(ctx2) }()
	otx := ctx1
	r.outboxNow = r.consumerNow
	if r.separate {
		if otx, err = snapshot(ctx, db, "outbox", &r.outboxNow); err != nil {
			return nil, err
		}
		defer func() { _ = otx.Rollback(ctx2) }()
	}
	r.rep.CheckedAt = r.outboxNow
	r.rep.DedupHorizon = r.consumerNow.Add(-cfg.DedupRetention)

	if err := r.run(ctx, otx, ctx1, kr, groups); err != nil {
		return nil, err
	}
	return r.rep, nil
}

// snapshot begins a REPEATABLE READ READ ONLY transaction on the what
// database and takes its snapshot, reading the database's clock into now.
func snapshot(ctx context.Context, db admin.Beginner, what string, now *time.Time) (pgx.Tx, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("read the %s database: %w", what, err)
	}
	// The first statement after SET TRANSACTION takes the snapshot.
	_, err = tx.Exec(ctx, `SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY`)
	if err == nil {
		err = tx.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(now)
	}
	if err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("read the %s database: %w", what, err)
	}
	return tx, nil
}

// consumerSQL renders a statement on the consumer tables.
func (r *runner) consumerSQL(query string) string { return sqlident.SQL(r.cfg.ConsumerSchema, query) }

func (r *runner) note(format string, args ...any) {
	r.rep.Notes = append(r.rep.Notes, fmt.Sprintf(format, args...))
}

// listGroups returns the groups to check: none when the consumer tables
// do not exist.
func (r *runner) listGroups(ctx context.Context, db admin.Beginner) ([]string, error) {
	var now time.Time
	tx, err := snapshot(ctx, db, "consumer", &now)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var present bool
	if err := tx.QueryRow(ctx, r.consumerSQL(tablesPresentSQL)).Scan(&present); err != nil {
		return nil, fmt.Errorf("look for the consumer tables in schema %s: %w", r.cfg.ConsumerSchema, err)
	}
	if !present {
		r.note("consumer tables: not found in schema %s (migration 002_consumer is not applied there), so no consumer group was checked", r.cfg.ConsumerSchema)
		return nil, nil
	}
	groups := slices.Clone(r.cfg.Groups)
	if len(groups) == 0 {
		if groups, err = r.store.RecordingGroups(ctx, tx); err != nil {
			return nil, err
		}
	}
	slices.Sort(groups)
	return slices.Compact(groups), nil
}

// run does the checks inside the snapshots.
func (r *runner) run(ctx context.Context, otx, ctx1 pgx.Tx, kr *kafkaReader, groups []string) error {
	cfg := r.cfg
	shards, err := outbox.ShardCount(ctx, otx, cfg.Schema)
	if err != nil {
		return err
	}
	r.rep.Outbox.Shards = shards
	r.note("dedup records are assumed kept for %s (the retention `eventline cleanup` runs with): an event committed before %s without one is counted as unverifiable, not lost",
		human(cfg.DedupRetention), r.rep.DedupHorizon.UTC().Format(time.RFC3339))

	for _, step := range []struct {
		name string
		fn   func() error
	}{
		{"groups", func() error { return r.setUpGroups(ctx, otx, ctx1, groups, shards) }},
		{"kafka", func() error {
			if kr == nil {
				return nil
			}
			return r.readKafka(ctx, kr)
		}},
		{"outbox", func() error { return r.checkOutbox(ctx, otx, shards) }},
		{"reconcile", func() error { return r.reconcile(ctx, otx, ctx1, shards) }},
		{"consumer state", func() error { return r.checkConsumerState(ctx, ctx1) }},
	} {
		start := time.Now()
		if err := step.fn(); err != nil {
			return err
		}
		cfg.Logger.Debug("eventline verify: step done", "step", step.name, "elapsed", time.Since(start))
	}
	r.finish()
	return nil
}

// setUpGroups decides each group's topics: configured, else those its
// Kafka consumer group committed offsets for, else those of the events it
// has dedup records or parked events of.
func (r *runner) setUpGroups(ctx context.Context, otx, ctx1 pgx.Tx, groups []string, shards int) error {
	if len(groups) == 0 {
		return nil
	}
	recording, err := r.store.RecordingGroups(ctx, ctx1)
	if err != nil {
		return err
	}
	withRecords, err := r.store.ProcessedGroups(ctx, ctx1)
	if err != nil {
		return err
	}
	var infer []string
	for _, g := range groups {
		gs := &groupState{rep: &GroupReport{Group: g, Outcomes: map[string]int64{}, DeadLetterSources: []string{"held_events"}}, topics: map[string]bool{}}
		r.groups[g] = gs
		// A group that has versions but no dedup records runs the version
		// gate without dedup; one with neither has not handled anything
		// yet, and all its events are pending.
		gs.dedup = slices.Contains(withRecords, g) || !slices.Contains(recording, g)
		if !gs.dedup {
			r.note("group %s: keeps versions but no dedup records, so its applied events cannot be told from lost ones; only its order, parked, skipped and dead-lettered events are checked", g)
		}
		gs.rep.Deduplicates = gs.dedup
		switch {
		case len(r.cfg.GroupTopics[g]) > 0:
			gs.rep.TopicsFrom = "config"
			for _, t := range r.cfg.GroupTopics[g] {
				gs.topics[t] = true
			}
		case r.kafka != nil && len(r.kafka.committed[g]) > 0:
			gs.rep.TopicsFrom = "kafka"
			for tp := range r.kafka.committed[g] {
				gs.topics[tp.topic] = true
			}
		default:
			infer = append(infer, g)
		}
	}
	if len(infer) > 0 {
		add := func(t groupTopic) { r.groups[t.Group].topics[t.Topic] = true }
		err = each(ctx, ctx1, "read parked events' topics", add, r.consumerSQL(parkedTopicsSQL), infer)
		if err != nil {
			return err
		}
		// The topics of the events they have dedup records of.
		err = r.overEvents(ctx, otx, shards, inferTopicsSQL, func(query string, args ...any) error {
			return each(ctx, ctx1, fmt.Sprintf("find the topics of groups %v", infer), add, r.consumerSQL(query), args...)
		}, infer)
		if err != nil {
			return err
		}
		for _, g := range infer {
			gs := r.groups[g]
			gs.rep.TopicsFrom = "records"
			if len(gs.topics) == 0 {
				gs.rep.TopicsFrom = "none"
				r.note("group %s: no topics known (none configured, no Kafka offsets, no records of outbox events), so its pending and lost events are not checked; name them with -group-topics %s=topic,…", g, g)
			}
		}
	}
	for _, gs := range r.groups {
		gs.rep.Topics = slices.Sorted(maps.Keys(gs.topics))
	}
	return nil
}

// overEvents runs a statement over each shard's events in the window:
// build makes it from the events relation and the number of its first
// parameter after the events' own, and run runs it with args after them.
// With the consumer tables in the outbox's database the events are a
// subquery (eventsSQL); else they are streamed from the outbox and passed
// in chunks, as JSON (chunkEventsSQL).
func (r *runner) overEvents(ctx context.Context, otx pgx.Tx, shards int, build func(events string, p int) string,
	run func(query string, args ...any) error, args ...any) error {
	for shard := 0; shard < shards; shard++ {
		if !r.separate {
			if err := run(build(eventsSQL(r.cfg.Schema, shard), 3), append([]any{r.rep.Since, r.rep.Until}, args...)...); err != nil {
				return err
			}
			continue
		}
		err := scanOutboxEvents(ctx, otx, r.cfg.Schema, shard, r.rep.Since, r.rep.Until, r.cfg.ChunkSize, func(chunk []outboxEvent) error {
			return run(build(chunkEventsSQL, chunkParams), append([]any{chunk}, args...)...)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// readKafka reads the groups' topics.
func (r *runner) readKafka(ctx context.Context, kr *kafkaReader) error {
	topics := map[string]bool{}
	for _, gs := range r.groups {
		for t := range gs.topics {
			topics[t] = true
		}
	}
	return kr.read(ctx, r.kafka, slices.Sorted(maps.Keys(topics)))
}

// checkOutbox summarizes the outbox and reports the relay's dead letters.
func (r *runner) checkOutbox(ctx context.Context, otx pgx.Tx, shards int) error {
	sum := &r.rep.Outbox
	var oldest *time.Time
	for shard := 0; shard < shards; shard++ {
		var events, relayed int64
		var o *time.Time
		err := otx.QueryRow(ctx, outbox.SQL(r.cfg.Schema, shard, outboxSummarySQL), r.rep.Since, r.rep.Until, outbox.RelayConsumerGroup).Scan(&events, &relayed, &o)
		if err != nil {
			return fmt.Errorf("read outbox shard %d: %w", shard, err)
		}
		sum.Events += events
		sum.Relayed += relayed
		sum.Pending += events - relayed
		if o != nil && (oldest == nil || o.Before(*oldest)) {
			oldest = o
		}
	}
	if oldest != nil {
		sum.OldestPendingSeconds = max(r.outboxNow.Sub(*oldest), 0).Seconds()
	}
	if err := otx.QueryRow(ctx, sqlident.SQL(r.cfg.Schema, `SELECT count(*) FROM {schema}.relay_failures`)).Scan(&sum.Retrying); err != nil {
		return fmt.Errorf("count relay retries: %w", err)
	}
	// Discarded ones included: discarding does not deliver them.
	return each(ctx, otx, "read the relay's dead letters", func(d heldRow) {
		sum.DeadLetters++
		detail := fmt.Sprintf("dead-lettered by the relay (held event %d, shard %d) after %d attempt(s): %s", d.ID, d.Shard, d.Attempts, held.Truncate(d.Reason, maxReasonLength))
		if d.LastError != "" && d.LastError != d.Reason {
			detail += "; last error: " + held.Truncate(d.LastError, maxReasonLength)
		}
		f := d.finding(Problem, DeadLetter, r.outboxNow, detail+" — replay it with `eventline held replay "+fmt.Sprint(d.ID)+"`")
		f.Topic = d.Topic
		r.details.add(f)
	}, sqlident.SQL(r.cfg.Schema, heldSQL("relay_dead_letter", open+", 'discarded'")), r.rep.Since, r.rep.Until, []string{""})
}

// reconcile matches every outbox event of the window with the records of
// the groups that consume its topic.
func (r *runner) reconcile(ctx context.Context, otx, ctx1 pgx.Tx, shards int) error {
	var gs, ts []string
	for _, g := range slices.Sorted(maps.Keys(r.groups)) {
		for t := range r.groups[g].topics {
			gs, ts = append(gs, g), append(ts, t)
		}
	}
	if len(gs) == 0 {
		return nil
	}
	return r.overEvents(ctx, otx, shards, classifySQL, func(query string, args ...any) error { return r.classify(ctx, ctx1, query, args...) }, gs, ts)
}

// finish assembles the report.
func (r *runner) finish() {
	for _, g := range slices.Sorted(maps.Keys(r.groups)) {
		r.rep.Groups = append(r.rep.Groups, *r.groups[g].rep)
	}
	if r.kafka != nil {
		r.rep.Kafka.Checked = true
		for _, t := range r.kafka.topics {
			ts := t.summary
			r.rep.Kafka.Topics = append(r.rep.Kafka.Topics, ts)
			switch {
			case ts.Missing:
				r.note("Kafka topic %s does not exist: its events are not traced on Kafka", ts.Topic)
			case ts.Compacted:
				r.note("Kafka topic %s is compacted: an event missing from it proves nothing", ts.Topic)
			}
		}
	}
	r.details.into(r.rep)
	r.rep.finish()
	slices.Sort(r.rep.Notes)
}

// human formats a duration without trailing zero units: 5m, 1h30m, 7d.
func human(d time.Duration) string {
	const day = 24 * time.Hour
	if d >= day && d%day == 0 {
		return fmt.Sprintf("%dd", d/day)
	}
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}
