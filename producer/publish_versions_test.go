package producer_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// TestPublishTxMirroredCallsNeverDeadlock runs, many times over, two
// transactions that publish to the same two aggregates with mirrored mixes:
// one supplies A's version and lets B's be assigned, the other the
// reverse. Every aggregate row must be locked in one ordered pass, so
// neither ever fails with a deadlock (SQLSTATE 40P01).
func TestPublishTxMirroredCallsNeverDeadlock(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 4})
	// Gaps allowed, so every supplied version (from a shared, steeply
	// rising counter) is above the last one whatever order the two
	// commit in: the only possible failure is the locking.
	p := newProducerWith(t, env, producer.Config{AllowVersionGaps: true})
	ctx := context.Background()
	var counter atomic.Int64
	counter.Store(1000)
	supplied := func(id string) eventline.Event { return versioned(t, id, counter.Add(10)) }

	const rounds = 150
	for round := 0; round < rounds; round++ {
		var start, wg sync.WaitGroup
		start.Add(2)
		errs := make([]error, 2)
		calls := [2]func() []eventline.Event{
			func() []eventline.Event { return []eventline.Event{supplied("A"), orderEvent(t, "B")} },
			func() []eventline.Event { return []eventline.Event{orderEvent(t, "A"), supplied("B")} },
		}
		for w := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[w] = pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
					start.Done()
					start.Wait() // both transactions are open before either publishes
					if err := p.PublishTx(ctx, tx, calls[w]()...); err != nil {
						return err
					}
					time.Sleep(time.Millisecond) // hold the locks a little
					return nil
				})
			}()
		}
		wg.Wait()
		for _, err := range errs {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) {
				require.NotEqual(t, "40P01", pgErr.Code, "round %d: deadlock: %v", round, err)
			}
			require.NoError(t, err, "round %d", round)
		}
	}
	a, _, _ := sequence(t, env, "order", "A")
	require.Greater(t, a, int64(1000))
	require.Len(t, versionsOf(t, env, "A"), 2*rounds)
	require.Len(t, versionsOf(t, env, "B"), 2*rounds)
}

// TestPublishTxRefusesVersionGapWithoutOptIn: a supplied version must be
// exactly the next one; a jump fails with a typed error, writes nothing and
// leaves the transaction usable.
func TestPublishTxRefusesVersionGapWithoutOptIn(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	ctx := context.Background()
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "a"))) // version 1

	tx := mustTx(t, env)
	err := p.PublishTx(ctx, tx, orderEvent(t, "other"), versioned(t, "a", 10))
	require.ErrorIs(t, err, producer.ErrVersionGap)
	var gap *producer.VersionGapError
	require.ErrorAs(t, err, &gap)
	require.Equal(t, producer.VersionGapError{AggregateType: "order", AggregateID: "a", Version: 10, Next: 2}, *gap)
	require.ErrorContains(t, err, "AllowVersionGaps")
	requireUsable(t, tx)
	_, _, ok := sequence(t, env, "order", "other")
	require.False(t, ok)
	// Nothing was written: the next version is still 2, for both kinds.
	written, err := p.PublishTxReturning(ctx, tx, orderEvent(t, "a"), orderEvent(t, "other"))
	require.NoError(t, err)
	require.EqualValues(t, 2, written[0].AggregateVersion)
	require.EqualValues(t, 1, written[1].AggregateVersion)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []int64{1, 2}, versionsOf(t, env, "a"))

	// A gap between two supplied versions of one call is refused before
	// any SQL runs.
	err = p.PublishTx(ctx, closedTx(t, env), versioned(t, "a", 3), versioned(t, "a", 5))
	require.ErrorAs(t, err, &gap)
	require.EqualValues(t, 4, gap.Next)

	// The next version is accepted, also after events without a version
	// in the same call.
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "a"), versioned(t, "a", 4), orderEvent(t, "a")))
	require.Equal(t, []int64{1, 2, 3, 4, 5}, versionsOf(t, env, "a"))
	// A first event may be supplied as version 1, not as any other.
	require.ErrorAs(t, p.Publish(ctx, env.Pool, versioned(t, "fresh", 3)), &gap)
	require.NoError(t, p.Publish(ctx, env.Pool, versioned(t, "fresh", 1)))
	// A version that was taken is a conflict, not a gap.
	err = p.Publish(ctx, env.Pool, versioned(t, "a", 5))
	var conflict *producer.VersionConflictError
	require.ErrorAs(t, err, &conflict)
	require.Equal(t, producer.VersionConflictError{AggregateType: "order", AggregateID: "a", Version: 5, Current: 5, Next: 6}, *conflict)
	err = p.Publish(ctx, env.Pool, orderEvent(t, "a"), versioned(t, "a", 6))
	require.ErrorAs(t, err, &conflict)
	require.EqualValues(t, 7, conflict.Next, "the event before it takes version 6")
	require.ErrorContains(t, err, "1 event(s) without a version before it")
}

// TestPublishTxVersionGapOptInCarriesPreviousVersion: with gaps allowed, an
// event records the version it follows, so consumers apply it after that
// one; events without a hole carry nothing extra.
func TestPublishTxVersionGapOptInCarriesPreviousVersion(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducerWith(t, env, producer.Config{AllowVersionGaps: true})
	ctx := context.Background()
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "a"))) // version 1

	tx := mustTx(t, env)
	written, err := p.PublishTxReturning(ctx, tx, versioned(t, "a", 10), orderEvent(t, "a"), versioned(t, "fresh", 5))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	type vp struct{ version, previous int64 }
	got := func(e eventline.Event) vp { return vp{e.AggregateVersion, e.PreviousVersion} }
	require.Equal(t, []vp{{10, 1}, {11, 10}, {5, eventline.NoPreviousVersion}}, []vp{got(written[0]), got(written[1]), got(written[2])})

	stored, md := storedEvent(t, env, written[0].ID)
	require.Equal(t, "1", md[eventline.MetaPreviousVersion])
	require.Equal(t, vp{10, 1}, got(stored))
	stored, md = storedEvent(t, env, written[1].ID)
	require.NotContains(t, md, eventline.MetaPreviousVersion, "no hole: the record carries no predecessor")
	require.Equal(t, vp{11, 10}, got(stored))
	stored, md = storedEvent(t, env, written[2].ID)
	require.Equal(t, "0", md[eventline.MetaPreviousVersion], "a first event numbered 5 follows version 0")
	require.Equal(t, vp{5, eventline.NoPreviousVersion}, got(stored))

	// Events without a version before a supplied one follow the last
	// version; the supplied one follows them.
	tx = mustTx(t, env)
	written, err = p.PublishTxReturning(ctx, tx, orderEvent(t, "a"), versioned(t, "a", 20), orderEvent(t, "a"))
	require.NoError(t, err)
	require.Equal(t, []vp{{12, 11}, {20, 12}, {21, 20}}, []vp{got(written[0]), got(written[1]), got(written[2])})
	// Still not at or below the last version.
	_, err = p.PublishTxReturning(ctx, tx, versioned(t, "a", 21))
	require.ErrorIs(t, err, producer.ErrVersionConflict)
	requireUsable(t, tx)
}

// TestPublishTxUndoesARacedSuppliedVersion builds the race the statement's
// verification exists for: the call reads an aggregate's version, another
// transaction advances it before the call locks the row. The call must
// write nothing (not even the sequence of the new aggregate it created in
// the same statement), report the conflict and leave the transaction
// usable; with gaps allowed, it runs again and the event follows the
// version that is really the last one.
func TestPublishTxUndoesARacedSuppliedVersion(t *testing.T) {
	t.Parallel()
	for _, gaps := range []bool{false, true} {
		env := pgtest.New(t, pgtest.Options{MaxConns: 4})
		p := newProducerWith(t, env, producer.Config{AllowVersionGaps: gaps})
		ctx := context.Background()
		require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "z"))) // z at version 1

		holder := mustTx(t, env)
		require.NoError(t, p.PublishTx(ctx, holder, orderEvent(t, "z"))) // z at 2, locked until commit

		racer := mustTx(t, env)
		var pid uint32
		require.NoError(t, racer.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
		// "a" sorts before "z": the statement creates a's sequence row,
		// then waits for z's lock, having read z at version 1.
		done := make(chan []eventline.Event, 1)
		errc := make(chan error, 1)
		go func() {
			written, err := p.PublishTxReturning(ctx, racer, orderEvent(t, "a"), versioned(t, "z", 2+boolInt(gaps)*8))
			done <- written
			errc <- err
		}()
		waitBlocked(t, env, pid)
		require.NoError(t, holder.Commit(ctx))
		written, err := <-done, <-errc
		requireUsable(t, racer)
		if !gaps {
			var conflict *producer.VersionConflictError
			require.ErrorAs(t, err, &conflict)
			require.Equal(t, producer.VersionConflictError{AggregateType: "order", AggregateID: "z", Version: 2, Current: 2, Next: 3}, *conflict)
			// Nothing of the call is left in the transaction.
			require.NoError(t, racer.Commit(ctx))
			_, _, ok := sequence(t, env, "order", "a")
			require.False(t, ok, "the new aggregate's sequence row was undone")
			require.Empty(t, versionsOf(t, env, "a"))
			v, _, _ := sequence(t, env, "order", "z")
			require.EqualValues(t, 2, v)
			continue
		}
		require.NoError(t, err)
		require.EqualValues(t, 1, written[0].AggregateVersion)
		require.EqualValues(t, 10, written[1].AggregateVersion)
		require.EqualValues(t, 2, written[1].PreviousVersion, "follows the version the other transaction published")
		require.NoError(t, racer.Commit(ctx))
		stored, _ := storedEvent(t, env, written[1].ID)
		require.EqualValues(t, 2, stored.PreviousVersion)
		require.Equal(t, []int64{1}, versionsOf(t, env, "a"))
		v, _, _ := sequence(t, env, "order", "a")
		require.EqualValues(t, 1, v)
	}
}

func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// waitBlocked waits until the backend pid waits for a lock.
func waitBlocked(t *testing.T, env pgtest.Env, pid uint32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var waiting bool
		require.NoError(t, env.Pool.QueryRow(context.Background(),
			`SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting))
		if waiting {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("backend %d never waited for a lock", pid)
}

func onTopic(e eventline.Event, topic string) eventline.Event {
	e.Topic = topic
	return e
}

// TestPublishTxKeepsAnAggregateOnOneTopic: an aggregate's events all go to
// the topic of its first event; an event for another topic is refused with
// both topics named, nothing written and the transaction usable. Otherwise
// a consumer group reading one topic would wait forever for the versions
// that went to the other.
func TestPublishTxKeepsAnAggregateOnOneTopic(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env) // default topic "orders"
	ctx := context.Background()
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "a")))
	_, topic, _ := sequence(t, env, "order", "a")
	require.Equal(t, "orders", *topic, "recorded with the first event")

	// Each write path: one event; several events of several aggregates;
	// a supplied version.
	for name, events := range map[string][]eventline.Event{
		"one event":        {onTopic(orderEvent(t, "a"), "billing")},
		"several":          {orderEvent(t, "b"), onTopic(orderEvent(t, "a"), "billing"), orderEvent(t, "c")},
		"supplied version": {orderEvent(t, "b"), onTopic(versioned(t, "a", 2), "billing")},
	} {
		tx := mustTx(t, env)
		err := p.PublishTx(ctx, tx, events...)
		require.ErrorIs(t, err, producer.ErrTopicConflict, name)
		var tc *producer.TopicConflictError
		require.ErrorAs(t, err, &tc, name)
		require.Equal(t, producer.TopicConflictError{AggregateType: "order", AggregateID: "a", Topic: "orders", Requested: "billing"}, *tc, name)
		require.ErrorContains(t, err, `"orders"`)
		require.ErrorContains(t, err, `"billing"`)
		requireUsable(t, tx)
		// Nothing of the call was written: the other aggregates' versions
		// start at 1, a's goes on at 2.
		written, err := p.PublishTxReturning(ctx, tx, orderEvent(t, "a"), orderEvent(t, "b"))
		require.NoError(t, err, name)
		require.EqualValues(t, []int64{2, 1}, []int64{written[0].AggregateVersion, written[1].AggregateVersion}, name)
		require.NoError(t, tx.Rollback(ctx))
		_, _, ok := sequence(t, env, "order", "b")
		require.False(t, ok, name)
	}

	// Two topics for one aggregate in one call: refused before any SQL.
	err := p.PublishTx(ctx, closedTx(t, env), orderEvent(t, "n"), onTopic(orderEvent(t, "n"), "billing"))
	var tc *producer.TopicConflictError
	require.ErrorAs(t, err, &tc)
	require.Equal(t, producer.TopicConflictError{AggregateType: "order", AggregateID: "n", Topic: "orders", Requested: "billing"}, *tc)

	// Another aggregate type with the same id is another aggregate.
	require.NoError(t, p.Publish(ctx, env.Pool, eventline.Event{Type: "invoice.sent", AggregateType: "invoice", AggregateID: "a", Topic: "billing", Payload: []byte(`{}`)}))
	require.Equal(t, 0, outboxRowsFor(t, env, "billing", "order"))
}

// TestPublishTxRecordsTheTopicOfOlderAggregates: aggregates whose sequence
// row predates topics (NULL) get their topic recorded by their next
// publish, whichever write path it takes.
func TestPublishTxRecordsTheTopicOfOlderAggregates(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	ctx := context.Background()
	_, err := env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "aggregate_sequences")+
		` (aggregate_type, aggregate_id, version) VALUES ('order', 'one', 4), ('order', 'many', 7), ('order', 'sup', 2)`)
	require.NoError(t, err)

	tx := mustTx(t, env)
	written, err := p.PublishTxReturning(ctx, tx, orderEvent(t, "one"))
	require.NoError(t, err)
	require.EqualValues(t, 5, written[0].AggregateVersion)
	require.NoError(t, tx.Rollback(ctx)) // and the topic with it
	_, topic, _ := sequence(t, env, "order", "one")
	require.Nil(t, topic)
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "one")))
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "many"), orderEvent(t, "x"), orderEvent(t, "many")))
	require.NoError(t, p.Publish(ctx, env.Pool, versioned(t, "sup", 3)))
	for id, want := range map[string]int64{"one": 5, "many": 9, "sup": 3, "x": 1} {
		v, topic, ok := sequence(t, env, "order", id)
		require.True(t, ok, id)
		require.Equal(t, want, v, id)
		require.NotNil(t, topic, id)
		require.Equal(t, "orders", *topic, id)
	}
	require.Equal(t, []int64{8, 9}, versionsOf(t, env, "many"))
	require.ErrorIs(t, p.Publish(ctx, env.Pool, onTopic(orderEvent(t, "one"), "billing")), producer.ErrTopicConflict)
}

func outboxRowsFor(t *testing.T, env pgtest.Env, topic, aggregateType string) int {
	t.Helper()
	n := 0
	for s := 0; s < env.Shards; s++ {
		n += pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(env.Schema, outbox.Table(s))+
			` WHERE payload->>'destination_topic' = $1 AND payload->'metadata'->>'aggregate_type' = $2`, topic, aggregateType)
	}
	return n
}

// TestPublishTxTrustsTheCallersVersions: events of an aggregate type in
// Config.CallerVersionedTypes must carry their version, and are written
// with it and nothing else: no aggregate_sequences row. Within a call the
// versions must still follow each other. A call mixing them with
// assigned-version aggregates writes both, and writes nothing when the
// others conflict.
func TestPublishTxTrustsTheCallersVersions(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducerWith(t, env, producer.Config{DefaultTopic: "orders", CallerVersionedTypes: []string{"order"}})
	ctx := context.Background()

	require.NoError(t, p.Publish(ctx, env.Pool, versioned(t, "a", 1)))
	written, err := p.PublishAndCommit(ctx, env.Pool, func(pgx.Tx) ([]eventline.Event, error) {
		return []eventline.Event{versioned(t, "a", 2), versioned(t, "a", 3)}, nil
	})
	require.NoError(t, err)
	require.EqualValues(t, []int64{2, 3}, []int64{written[0].AggregateVersion, written[1].AggregateVersion})
	require.EqualValues(t, []int64{1, 2}, []int64{written[0].PreviousVersion, written[1].PreviousVersion})
	tx := mustTx(t, env)
	written, err = p.PublishTxReturning(ctx, tx, versioned(t, "a", 4))
	require.NoError(t, err)
	require.EqualValues(t, 3, written[0].PreviousVersion)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []int64{1, 2, 3, 4}, versionsOf(t, env, "a"))
	_, _, ok := sequence(t, env, "order", "a")
	require.False(t, ok, "no sequence row for a caller-versioned aggregate")

	// Refused before any SQL: a missing version, a version that does not
	// follow the one before it in the call.
	tx = mustTx(t, env)
	err = p.PublishTx(ctx, tx, orderEvent(t, "b"))
	require.ErrorIs(t, err, eventline.ErrInvalidEvent)
	require.ErrorContains(t, err, "CallerVersionedTypes")
	require.ErrorIs(t, p.PublishTx(ctx, tx, versioned(t, "b", 1), versioned(t, "b", 3)), producer.ErrVersionGap)
	require.ErrorIs(t, p.PublishTx(ctx, tx, versioned(t, "b", 2), versioned(t, "b", 2)), eventline.ErrInvalidEvent)
	requireUsable(t, tx)
	require.NoError(t, tx.Rollback(ctx))

	// Mixed with an assigned-version aggregate: both written, the
	// sequence only for the other one, each event with its version.
	invoice := func(id, topic string) eventline.Event {
		return eventline.Event{Type: "invoice.sent", AggregateType: "invoice", AggregateID: id, Topic: topic, Payload: []byte(`{}`)}
	}
	written, err = p.PublishAndCommit(ctx, env.Pool, func(pgx.Tx) ([]eventline.Event, error) {
		return []eventline.Event{invoice("i", ""), versioned(t, "a", 5), invoice("i", "")}, nil
	})
	require.NoError(t, err)
	require.EqualValues(t, []int64{1, 5, 2}, []int64{written[0].AggregateVersion, written[1].AggregateVersion, written[2].AggregateVersion})
	v, _, ok := sequence(t, env, "invoice", "i")
	require.True(t, ok)
	require.EqualValues(t, 2, v)
	require.Equal(t, []int64{1, 2, 3, 4, 5}, versionsOf(t, env, "a"))

	// When the other aggregate conflicts, nothing of the call is written
	// and the transaction stays usable (PublishTx).
	rows := outboxCount(t, env)
	tx = mustTx(t, env)
	err = p.PublishTx(ctx, tx, versioned(t, "a", 6), invoice("i", "billing"))
	var tc *producer.TopicConflictError
	require.ErrorAs(t, err, &tc)
	require.ErrorContains(t, err, "event 1:")
	requireUsable(t, tx)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, rows, outboxCount(t, env))
}

// TestCallerVersionedRowsAreWhatPublishTxWrites: a caller-versioned
// event's outbox row is byte for byte the row PublishTx writes for the
// same event when it checks the version against the aggregate's sequence.
func TestCallerVersionedRowsAreWhatPublishTxWrites(t *testing.T) {
	t.Parallel()
	envA := pgtest.New(t, pgtest.Options{Shards: 2})
	envB := pgtest.New(t, pgtest.Options{Shards: 2})
	ctx := context.Background()
	trusting := newProducerWith(t, envA, producer.Config{DefaultTopic: "orders", CallerVersionedTypes: []string{"order"}})
	checking := newProducerWith(t, envB, producer.Config{DefaultTopic: "orders"})
	at := time.Date(2024, 2, 29, 23, 59, 58, 123456789, time.UTC)
	calls := [][]eventline.Event{}
	n := 0
	for _, call := range [][][2]any{{{"x", 1}}, {{"x", 2}, {"y", 1}, {"x", 3}}, {{"y", 2}}} {
		var events []eventline.Event
		for _, ev := range call {
			e := versioned(t, ev[0].(string), int64(ev[1].(int)))
			e.ID, e.OccurredAt = "00000000-0000-7000-8000-0000000000"+strconv.Itoa(10+n), at
			e.Metadata = map[string]string{"tenant": "ü <b>&</b>"}
			events = append(events, e)
			n++
		}
		calls = append(calls, events)
	}
	for _, events := range calls {
		require.NoError(t, trusting.Publish(ctx, envA.Pool, events...))
		require.NoError(t, checking.Publish(ctx, envB.Pool, events...))
		for _, e := range events {
			a, b := rowsOf(t, envA, e.ID), rowsOf(t, envB, e.ID)
			require.Len(t, a, 1)
			require.Len(t, b, 1)
			require.Equal(t, b[0].payload, a[0].payload)
			require.Equal(t, b[0].metadata, a[0].metadata)
		}
	}
	require.Equal(t, 0, pgtest.Count(t, envA.Pool, `SELECT count(*) FROM `+envA.Schema+`.aggregate_sequences`))
}

// modelAgg is what the model knows of one aggregate.
type modelAgg struct {
	last    int64
	topic   string     // "" until recorded
	written [][2]int64 // (version, previous version) of every committed event
}

// callStep is one event of a generated call.
type callStep struct {
	agg      string
	topic    string
	supplied bool
	offset   int64 // supplied version = the version it should have + offset
}

// TestPublishTxVersionRulesProperty publishes random calls (mixes of
// supplied and assigned versions, right, stale and skipping ones, two
// topics, older aggregates without a recorded topic, with and without
// gaps allowed, committed or rolled back) and checks each outcome against
// a model of the rules: which error, or which versions and previous
// versions; and that the outbox holds exactly the committed events, each
// recording the version it follows.
func TestPublishTxVersionRulesProperty(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	strict := newProducerWith(t, env, producer.Config{DefaultTopic: "t1"})
	gaps := newProducerWith(t, env, producer.Config{DefaultTopic: "t1", AllowVersionGaps: true})
	ctx := context.Background()
	run := 0
	rapid.Check(t, func(rt *rapid.T) {
		run++
		ids := []string{fmt.Sprintf("r%d-a", run), fmt.Sprintf("r%d-b", run), fmt.Sprintf("r%d-c", run)}
		model := map[string]*modelAgg{}
		for _, id := range ids {
			model[id] = &modelAgg{}
			if rapid.IntRange(0, 3).Draw(rt, "legacy") == 0 {
				// A sequence row from before topics were recorded.
				last := int64(rapid.IntRange(1, 5).Draw(rt, "legacyVersion"))
				_, err := env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "aggregate_sequences")+
					` (aggregate_type, aggregate_id, version) VALUES ('order', $1, $2)`, id, last)
				require.NoError(rt, err)
				model[id].last = last
			}
		}
		for call := range rapid.IntRange(1, 8).Draw(rt, "calls") {
			allowGaps := rapid.Bool().Draw(rt, "gaps")
			steps := rapid.SliceOfN(rapid.Custom(func(rt *rapid.T) callStep {
				s := callStep{agg: rapid.SampledFrom(ids).Draw(rt, "agg"), topic: "t1"}
				if rapid.IntRange(0, 9).Draw(rt, "otherTopic") == 0 {
					s.topic = "t2"
				}
				if s.supplied = rapid.IntRange(0, 2).Draw(rt, "supplied") == 0; s.supplied {
					s.offset = rapid.SampledFrom([]int64{-1, 0, 0, 0, 1, 3}).Draw(rt, "offset")
				}
				return s
			}), 1, 4).Draw(rt, "steps")
			rollback := rapid.IntRange(0, 4).Draw(rt, "rollback") == 0

			events, want, wantErr := predict(model, steps, allowGaps)
			rt.Logf("call %d gaps=%v rollback=%v steps=%v want=%v wantErr=%v", call, allowGaps, rollback, steps, want, wantErr)
			p := strict
			if allowGaps {
				p = gaps
			}
			var written []eventline.Event
			err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
				var err error
				written, err = p.PublishTxReturning(ctx, tx, events...)
				if err != nil {
					requireUsable(rt, tx)
					return err
				}
				if rollback {
					return errRollback
				}
				return nil
			})
			if wantErr != nil {
				require.ErrorIs(rt, err, wantErr, "call %d: %v", call, steps)
				continue
			}
			if rollback {
				require.ErrorIs(rt, err, errRollback)
			} else {
				require.NoError(rt, err, "call %d: %v", call, steps)
			}
			for i, e := range written {
				w := want[i]
				if w[1] == 0 && w[0] > 1 {
					w[1] = eventline.NoPreviousVersion // follows version 0 (the record says "0")
				}
				require.Equal(rt, w, [2]int64{e.AggregateVersion, e.PreviousVersion}, "call %d event %d: %v", call, i, steps)
			}
			if rollback {
				continue
			}
			// Commit the model.
			for i, s := range steps {
				m := model[s.agg]
				m.last, m.topic = want[i][0], s.topic
				m.written = append(m.written, want[i])
			}
		}
		for _, id := range ids {
			require.Equal(rt, model[id].written, storedVersions(rt, env, id), "aggregate %s", id)
			v, _, ok := sequence(rt, env, "order", id)
			require.Equal(rt, model[id].last, v, "aggregate %s", id)
			require.Equal(rt, model[id].last != 0, ok)
		}
	})
}

// predict returns the call's events and, per the rules, either the
// (version, previous version) each gets or the error the call fails with.
func predict(model map[string]*modelAgg, steps []callStep, allowGaps bool) ([]eventline.Event, [][2]int64, error) {
	type agg struct {
		topic      string
		count      int64
		lead       int64
		firstIndex int   // index of the first event
		supIndex   int   // index of the first supplied event
		firstSup   int64 // 0: none
		last       int64 // running version, when known without the database
	}
	aggs := map[string]*agg{}
	events := make([]eventline.Event, len(steps))
	var clientErr error
	for i, s := range steps {
		m := model[s.agg]
		a := aggs[s.agg]
		if a == nil {
			a = &agg{topic: s.topic, firstIndex: i}
			aggs[s.agg] = a
		}
		// The version this event should have, from the model.
		should := m.last + a.count + 1
		e := eventline.Event{Type: "order.updated", AggregateType: "order", AggregateID: s.agg, Topic: s.topic, Payload: []byte(`{}`)}
		if s.supplied {
			e.AggregateVersion = max(should+s.offset, 1)
		}
		events[i] = e
		if clientErr != nil {
			continue
		}
		switch {
		case s.topic != a.topic:
			clientErr = producer.ErrTopicConflict
		case !s.supplied && a.firstSup != 0:
			a.last++
		case !s.supplied:
			a.lead++
		case a.firstSup != 0 && e.AggregateVersion <= a.last:
			clientErr = eventline.ErrInvalidEvent
		case a.firstSup != 0 && e.AggregateVersion != a.last+1 && !allowGaps:
			clientErr = producer.ErrVersionGap
		case a.firstSup != 0:
			a.last = e.AggregateVersion
		default:
			a.firstSup, a.supIndex, a.last = e.AggregateVersion, i, e.AggregateVersion
		}
		a.count++
	}
	if clientErr != nil {
		return events, nil, clientErr
	}
	// The database's checks: the first conflicting aggregate, by the index
	// of the event that conflicts.
	var dbErr error
	errIndex := len(steps)
	for id, a := range aggs {
		m := model[id]
		var err error
		index := a.supIndex
		switch {
		case m.topic != "" && m.topic != a.topic:
			err, index = producer.ErrTopicConflict, a.firstIndex
		case a.firstSup == 0:
		case m.last+a.lead >= a.firstSup:
			err = producer.ErrVersionConflict
		case !allowGaps && m.last+a.lead+1 != a.firstSup:
			err = producer.ErrVersionGap
		}
		if err != nil && index < errIndex {
			dbErr, errIndex = err, index
		}
	}
	if dbErr != nil {
		return events, nil, dbErr
	}
	want := make([][2]int64, len(steps))
	running := map[string]int64{}
	for id := range aggs {
		running[id] = model[id].last
	}
	for i, e := range events {
		prev := running[e.AggregateID]
		v := e.AggregateVersion
		if v == 0 {
			v = prev + 1
		}
		want[i] = [2]int64{v, prev}
		running[e.AggregateID] = v
	}
	return events, want, nil
}

// storedVersions returns (version, previous version) of an order's events
// in the outbox, in outbox order.
func storedVersions(t require.TestingT, env pgtest.Env, id string) [][2]int64 {
	var out [][2]int64
	for s := 0; s < env.Shards; s++ {
		rows, err := env.Pool.Query(context.Background(), `SELECT (payload->'metadata'->>'aggregate_version')::bigint,
			coalesce((payload->'metadata'->>'aggregate_previous_version')::bigint, (payload->'metadata'->>'aggregate_version')::bigint - 1)
			FROM `+sqlident.Qualify(env.Schema, outbox.Table(s))+` WHERE payload->'metadata'->>'aggregate_id' = $1 ORDER BY transaction_id, "offset"`, id)
		require.NoError(t, err)
		got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) ([2]int64, error) {
			var vp [2]int64
			return vp, r.Scan(&vp[0], &vp[1])
		})
		require.NoError(t, err)
		out = append(out, got...)
	}
	return out
}
