// Package held is the store of held_events: the events eventline holds for
// the operator, of three kinds (the relay's dead letters, the consumers'
// dead letters, late events) with one status life. Every statement on the
// table outside the version gate's is here, written as SQL with a
// {schema} placeholder and rendered once per store. The relay writes its
// dead letters with [Store.AddRelay], the consumer its own with
// [Store.AddDeadLetter]; package admin lists, replays and discards them;
// the consumer claims those whose replay was requested.
package held

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
)

// Kind is the kind of a held event.
type Kind string

// The kinds of held events, documented where operators meet them:
// admin.HeldRelayDeadLetter, admin.HeldDeadLetter, admin.HeldLate.
const (
	KindRelayDeadLetter Kind = "relay_dead_letter"
	KindDeadLetter      Kind = "dead_letter"
	KindLate            Kind = "late"
)

// Valid reports whether k is a known kind.
func (k Kind) Valid() bool { return k == KindRelayDeadLetter || k == KindDeadLetter || k == KindLate }

// Status is where a held event is in its life.
type Status string

// The statuses of a held event, documented on admin.StatusHeld,
// admin.StatusReplayRequested, admin.StatusReplayed and
// admin.StatusDiscarded.
const (
	StatusHeld            Status = "held"
	StatusReplayRequested Status = "replay_requested"
	StatusReplayed        Status = "replayed"
	StatusDiscarded       Status = "discarded"
)

// Valid reports whether s is a known status.
func (s Status) Valid() bool {
	return s == StatusHeld || s == StatusReplayRequested || s == StatusReplayed || s == StatusDiscarded
}

// Open are the statuses of events still waiting for an operator or a
// replay.
var Open = []Status{StatusHeld, StatusReplayRequested}

// Causes: why an event is held (Event.Cause). Components that dead-letter
// for their own reasons add their own.
const (
	// CausePermanent: the event can never succeed as it is (it does not
	// decode, no handler knows its type, the handler marked its error
	// permanent…).
	CausePermanent = "permanent"
	// CauseRetriesExhausted: delivering it kept failing until the retry
	// budget was spent (the handler's, or the relay's publishes).
	CauseRetriesExhausted = "retries_exhausted"
	// CauseFailed: the handler failed and no retry middleware ran.
	CauseFailed = "failed"
	// CauseIDConflict: the event reused the id of a different event of
	// its aggregate the group already recorded.
	CauseIDConflict = "id_conflict"
	// CauseRejected: the relay's publish failed for good: Kafka refused
	// it (too large, invalid topic…), or the event in the envelope is
	// invalid.
	CauseRejected = "rejected"
	// CauseMalformed: the outbox row cannot be read as an envelope.
	CauseMalformed = "malformed"
	// CauseArrivedLate: a late event that arrived after its version had
	// been given up on (recorded in skipped_versions).
	CauseArrivedLate = "arrived_late"
	// CausePassed: a late event that was parked, and its aggregate passed
	// its version without it.
	CausePassed = "passed"
	// CauseReleaseFailed: a late event that was parked and could not be
	// applied within the release-attempt limit; its version was given up.
	CauseReleaseFailed = "release_failed"
	// CauseVersionConflict: a replayed dead letter whose version another
	// event took while it was held. Never discarded as stale: the
	// operator applies it late or discards it.
	CauseVersionConflict = "version_conflict"
)

// Event is one row of held_events: an event held for the operator
// (admin.HeldEvent). The message is kept whole, every byte of its payload
// and headers as received (or, for the relay's, as its outbox row held
// it), with no size limit.
type Event struct {
	// ID orders held events as they were held; admin.ReplayHeld and
	// admin.DiscardHeld take it.
	ID int64
	// Kind says what held it. Cause says why: for dead letters
	// permanent, retries_exhausted, failed, id_conflict, gap_too_large or
	// a component's own, for the relay's rejected, retries_exhausted or
	// malformed; for late events arrived_late (its version had been given
	// up on), passed (parked, and its aggregate passed it), release_failed
	// (parked, and kept failing) or version_conflict (a replayed dead
	// letter whose version another event took while it was held). Reason
	// is the error or explanation, in full (up to 8 KiB).
	Kind   Kind
	Cause  string // see Kind
	Reason string // see Kind
	// Group is the consumer group holding it; empty for the relay's.
	Group string
	// EventID, EventType, AggregateType, AggregateID, AggregateVersion and
	// PreviousVersion come from the envelope when it decodes (a dead
	// letter's may not: then they are empty, 0).
	EventID          string
	EventType        string // see EventID
	AggregateType    string // see EventID
	AggregateID      string // see EventID
	AggregateVersion int64  // see EventID
	PreviousVersion  int64  // see EventID
	// CurrentVersion was the aggregate's version when a late event was
	// held.
	CurrentVersion int64
	// Topic is the topic it came from (consumer kinds) or was bound for
	// (the relay's); Handler the Watermill handler it was delivered to, and
	// a replay runs it through.
	Topic   string
	Handler string // see Topic
	// MessageUUID, Payload and Metadata are the message (the relay's: the
	// outbox row's uuid, the forwarder envelope and the row's metadata).
	MessageUUID string
	Payload     []byte
	Metadata    map[string]string // see MessageUUID
	// FromKafka is true when Partition, Offset and Key locate the record
	// on Kafka.
	FromKafka bool
	Partition int32  // see FromKafka
	Offset    int64  // see FromKafka
	Key       []byte // see FromKafka
	// Shard is the outbox shard of a relay dead letter.
	Shard int
	// HeldAt is when it was held (last, when a redelivered record was
	// dead-lettered again); Times counts how often.
	HeldAt time.Time
	Times  int // see HeldAt
	// Status, and the fields after it, record its life.
	Status            Status
	ReplayRequestedAt *time.Time // see Status
	ReplayedAt        *time.Time // see Status
	// Attempts counts failed attempts to deliver it: the relay's publishes
	// and a parked event's releases before it was held, and replays since
	// the last request. LastError is the last one's error; NextAttemptAt
	// when the consumer tries a requested replay again.
	Attempts      int
	LastError     string     // see Attempts
	LastAttemptAt *time.Time // see Attempts
	NextAttemptAt *time.Time // see Attempts
	DiscardedAt   *time.Time // see Status
	DiscardReason string     // see Status
}

// Message rebuilds the message as it was received (or, for the relay's,
// as the outbox row held it).
func (e Event) Message() *message.Message {
	msg := message.NewMessage(e.MessageUUID, append([]byte{}, e.Payload...))
	for k, v := range e.Metadata {
		msg.Metadata.Set(k, v)
	}
	return msg
}

// Filter selects held events (admin.HeldFilter). Empty fields match
// everything. Text is compared as stored: NUL bytes and invalid UTF-8
// become U+FFFD on both sides, so a hostile record is found by the group
// and aggregate it claimed.
type Filter struct {
	// Kind selects one kind.
	Kind Kind
	// Group selects one consumer group (the relay's have none).
	Group string
	// AggregateType and AggregateID select one aggregate.
	AggregateType string
	AggregateID   string // see AggregateType
	// IDs selects these held events (Event.ID) only.
	IDs []int64
	// Statuses selects these statuses (List only; it defaults to Open:
	// held and replay_requested). admin.ReplayHeld takes held ones,
	// Discard open ones.
	Statuses []Status
	// Limit caps List. Defaults to 100.
	Limit int
}

// ErrNone is returned when no held event matched.
var ErrNone = errors.New("eventline: no held event matched")

// DBTX is the smallest database handle the store needs (the outbox's, as
// the relay writes its dead letters in its own transaction).
type DBTX = outbox.DBTX

// maxReasonBytes bounds a stored reason or error (a panic's stack can be
// long).
const maxReasonBytes = 8 << 10

// defaultLimit is Filter.Limit's default.
const defaultLimit = 100

// Store runs the statements on held_events of one schema. It holds no
// connections and is safe for concurrent use.
type Store struct {
	addRelay, addDeadLetter               string
	list, lock, claim, earlier, countOpen string
	replayed, requested, replayFailed     string
	discard                               string
	lateAggregates, lockLate, lateApplied string
}

// columns are the columns scan reads, in its order.
const columns = `id, kind, cause, reason, consumer_group, event_id, event_type, aggregate_type, aggregate_id,
	aggregate_version, previous_version, current_version, topic, handler, message_uuid, payload, header_keys, header_values,
	kafka_partition, kafka_offset, kafka_key, shard, held_at, times_held, status, replay_requested_at, replayed_at,
	attempts, coalesce(last_error, ''), last_attempt_at, next_attempt_at, discarded_at, coalesce(discard_reason, '')`

// filter is Filter's predicate over $1 kind, $2 group, $3 aggregate type,
// $4 aggregate id, $5 ids and $6 statuses.
const filter = `($1 = '' OR kind = $1) AND ($2 = '' OR consumer_group = $2) AND ($3 = '' OR aggregate_type = $3)
	AND ($4 = '' OR aggregate_id = $4) AND (cardinality($5::bigint[]) = 0 OR id = ANY($5)) AND status = ANY($6)`

// replayOrder is the order replays go in: per aggregate by version, then
// as the records arrived, then as they were held.
const replayOrder = `aggregate_type, aggregate_id, aggregate_version, kafka_partition, kafka_offset, id`

// New returns the store of held_events in schema, which the caller has
// validated.
func New(schema string) *Store {
	q := func(query string) string { return sqlident.SQL(schema, query) }
	return &Store{
		// The relay's dead letter, in the relay's transaction ($1 cause,
		// $2 reason, $3 shard, $4 outbox uuid, $5..$9 event identity, $10
		// topic, $11 payload, $12 and $13 headers, $14 attempts, $15 last
		// error).
		addRelay: q(`INSERT INTO {schema}.held_events (kind, cause, reason, shard, message_uuid,
				event_id, event_type, aggregate_type, aggregate_id, aggregate_version, topic, payload, header_keys, header_values,
				attempts, last_error, last_attempt_at)
			VALUES ('relay_dead_letter', $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, now())`),
		// A consumer's dead letter. A record dead-lettered again
		// (redelivered after a crash, or failing again after a replay)
		// re-opens its row, with the new cause and reason; the record
		// itself is the same.
		addDeadLetter: q(`INSERT INTO {schema}.held_events AS h (kind, consumer_group, topic, handler, kafka_partition, kafka_offset, kafka_key,
				message_uuid, payload, header_keys, header_values, event_id, event_type, aggregate_type, aggregate_id, aggregate_version,
				previous_version, cause, reason)
			VALUES ('dead_letter', $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)
			ON CONFLICT (consumer_group, topic, kafka_partition, kafka_offset) WHERE kind = 'dead_letter' DO UPDATE
			SET cause = excluded.cause, reason = excluded.reason, held_at = now(), times_held = h.times_held + 1, status = 'held'
			RETURNING id`),
		list: q(`SELECT ` + columns + ` FROM {schema}.held_events WHERE ` + filter + ` ORDER BY id LIMIT $7`),
		// The rows an operator's replay takes, locked, in replay order.
		lock: q(`SELECT ` + columns + ` FROM {schema}.held_events WHERE ` + filter + ` ORDER BY ` + replayOrder + ` FOR UPDATE`),
		// A consumer's claim of its group's requested replays of one kind
		// ($1 group, $2 kind, $3 limit), skipping rows another replayer
		// holds.
		claim: q(`SELECT ` + columns + ` FROM {schema}.held_events
			WHERE consumer_group = $1 AND kind = $2 AND status = 'replay_requested' AND (next_attempt_at IS NULL OR next_attempt_at <= now())
			ORDER BY ` + replayOrder + ` LIMIT $3 FOR UPDATE SKIP LOCKED`),
		// The first held row of the aggregate ($1 group, $2 kind, $3 type,
		// $4 id) that comes before version $5 (or, at that version, before
		// id $6) and still waits for an operator.
		earlier: q(`SELECT id, aggregate_version FROM {schema}.held_events
			WHERE consumer_group = $1 AND kind = $2 AND status = 'held' AND aggregate_type = $3 AND aggregate_id = $4
				AND (aggregate_version < $5 OR (aggregate_version = $5 AND id < $6))
			ORDER BY aggregate_version, id LIMIT 1`),
		countOpen: q(`SELECT count(*) FROM {schema}.held_events WHERE consumer_group = $1 AND kind = $2 AND status IN ('held', 'replay_requested')`),
		replayed: q(`UPDATE {schema}.held_events SET status = 'replayed', replayed_at = now(), last_error = NULL, next_attempt_at = NULL
			WHERE id = ANY($1)`),
		// A replay request resets the attempts: the consumer gives up
		// after its limit of attempts per request.
		requested: q(`UPDATE {schema}.held_events SET status = 'replay_requested', replay_requested_at = now(), attempts = 0, next_attempt_at = NULL
			WHERE id = ANY($1)`),
		// A failed replay ($1 id, $2 error, $3 backoff in microseconds, $4
		// true to give up: back to held).
		replayFailed: q(`UPDATE {schema}.held_events SET attempts = attempts + 1, last_error = $2, last_attempt_at = now(),
				next_attempt_at = CASE WHEN $4 THEN NULL ELSE now() + $3::bigint * interval '1 microsecond' END,
				status = CASE WHEN $4 THEN 'held' ELSE status END
			WHERE id = $1`),
		// The group's aggregates with late events whose replay was
		// requested and is due ($1 group, $2 limit), those waiting longest
		// first, so aggregates whose events keep failing (each failure
		// pushes its next attempt back) cannot starve the others.
		lateAggregates: q(`SELECT aggregate_type, aggregate_id FROM {schema}.held_events
			WHERE consumer_group = $1 AND kind = 'late' AND status = 'replay_requested' AND (next_attempt_at IS NULL OR next_attempt_at <= now())
			GROUP BY aggregate_type, aggregate_id ORDER BY min(coalesce(next_attempt_at, replay_requested_at)) LIMIT $2`),
		// Those late events of one aggregate ($1 group, $2 type, $3 id, $4
		// limit), locked, in version order.
		lockLate: q(`SELECT ` + columns + ` FROM {schema}.held_events
			WHERE consumer_group = $1 AND kind = 'late' AND status = 'replay_requested' AND aggregate_type = $2 AND aggregate_id = $3
				AND (next_attempt_at IS NULL OR next_attempt_at <= now())
			ORDER BY aggregate_version, id LIMIT $4 FOR UPDATE`),
		// A late event applied ($1 id): replayed, its dedup record's
		// outcome late_applied.
		lateApplied: q(`WITH h AS (
				UPDATE {schema}.held_events SET status = 'replayed', replayed_at = now(), last_error = NULL, next_attempt_at = NULL
				WHERE id = $1 RETURNING consumer_group, event_id, aggregate_type, aggregate_id
			)
			UPDATE {schema}.processed_events p SET outcome = 'late_applied' FROM h
			WHERE p.consumer_group = h.consumer_group AND p.event_id = h.event_id AND p.aggregate_type = h.aggregate_type AND p.aggregate_id = h.aggregate_id`),
		// Discarding a late event records the outcome late_discarded in
		// the group's dedup record, so a redelivery stays a duplicate.
		discard: q(`WITH d AS (
				UPDATE {schema}.held_events SET status = 'discarded', discarded_at = now(), discard_reason = $7
				WHERE ` + filter + `
				RETURNING id, kind, consumer_group, event_id, aggregate_type, aggregate_id
			), o AS (
				UPDATE {schema}.processed_events p SET outcome = 'late_discarded' FROM d
				WHERE d.kind = 'late' AND p.consumer_group = d.consumer_group AND p.event_id = d.event_id
					AND p.aggregate_type = d.aggregate_type AND p.aggregate_id = d.aggregate_id
			)
			SELECT id FROM d`),
	}
}

// args returns f's statement arguments ($1..$6), its statuses defaulting
// to defaults.
func (f Filter) args(defaults ...Status) []any {
	statuses := f.Statuses
	if len(statuses) == 0 {
		statuses = defaults
	}
	st := make([]string, len(statuses))
	for i, x := range statuses {
		st[i] = string(x)
	}
	ids := f.IDs
	if ids == nil {
		ids = []int64{} // NULL would match nothing
	}
	// Stored text is cleaned (see AddDeadLetter): clean the filter the
	// same way, so a hostile record is found by the group and aggregate it
	// claimed.
	return []any{string(f.Kind), CleanText(f.Group), CleanText(f.AggregateType), CleanText(f.AggregateID), ids, st}
}

// List returns the held events f selects (open ones unless f.Statuses
// says otherwise), oldest first.
func (s *Store) List(ctx context.Context, db DBTX, f Filter) ([]Event, error) {
	if f.Limit <= 0 {
		f.Limit = defaultLimit
	}
	rows, err := db.Query(ctx, s.list, append(f.args(Open...), f.Limit)...)
	if err != nil {
		return nil, fmt.Errorf("list held events: %w", err)
	}
	return collect(rows)
}

// Lock locks, in tx, the held events f selects (those waiting for an
// operator unless f.Statuses says otherwise), in replay order: per
// aggregate by version.
func (s *Store) Lock(ctx context.Context, tx DBTX, f Filter) ([]Event, error) {
	rows, err := tx.Query(ctx, s.lock, f.args(StatusHeld)...)
	if err != nil {
		return nil, fmt.Errorf("select held events to replay: %w", err)
	}
	return collect(rows)
}

// MarkReplayed records that the given held events were replayed.
func (s *Store) MarkReplayed(ctx context.Context, db DBTX, ids ...int64) error {
	if _, err := db.Exec(ctx, s.replayed, ids); err != nil {
		return fmt.Errorf("mark held events %v replayed: %w", ids, err)
	}
	return nil
}

// MarkRequested asks for a replay of the given held events: a running
// consumer of each one's group picks them up.
func (s *Store) MarkRequested(ctx context.Context, db DBTX, ids ...int64) error {
	if _, err := db.Exec(ctx, s.requested, ids); err != nil {
		return fmt.Errorf("request the replay of held events %v: %w", ids, err)
	}
	return nil
}

// MarkReplayFailed records a failed replay of held event id: with giveUp
// it goes back to held (the operator decides again), else the consumer
// tries again after wait.
func (s *Store) MarkReplayFailed(ctx context.Context, db DBTX, id int64, replayErr string, wait time.Duration, giveUp bool) error {
	if _, err := db.Exec(ctx, s.replayFailed, id, CleanText(Truncate(replayErr, maxReasonBytes)), wait.Microseconds(), giveUp); err != nil {
		return fmt.Errorf("record the failed replay of held event %d: %w", id, err)
	}
	return nil
}

// Discard gives up on the open held events f selects, recording reason,
// and returns their ids, or ErrNone.
func (s *Store) Discard(ctx context.Context, db DBTX, f Filter, reason string) ([]int64, error) {
	f.Statuses = Open
	rows, err := db.Query(ctx, s.discard, append(f.args(), CleanText(Truncate(reason, maxReasonBytes)))...)
	if err != nil {
		return nil, fmt.Errorf("discard held events: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("discard held events: %w", err)
	}
	if len(ids) == 0 {
		return nil, ErrNone
	}
	slices.Sort(ids)
	return ids, nil
}

// Claim locks, in tx, up to limit of the group's held events of kind whose
// replay was requested and is due, in replay order, skipping those another
// replayer holds. Mark each with MarkReplayed or MarkReplayFailed in the
// same tx.
func (s *Store) Claim(ctx context.Context, tx pgx.Tx, group string, kind Kind, limit int) ([]Event, error) {
	rows, err := tx.Query(ctx, s.claim, group, string(kind), limit)
	if err != nil {
		return nil, fmt.Errorf("claim held events to replay: %w", err)
	}
	return collect(rows)
}

// EarlierHeld returns the id and version of the first held event of e's
// group, kind and aggregate that comes before e in replay order and still
// waits for an operator (status held), if any: replaying e before it would
// apply the aggregate's versions out of order. Events without an aggregate
// have none.
func (s *Store) EarlierHeld(ctx context.Context, db DBTX, e Event) (id, version int64, found bool, err error) {
	if e.AggregateType == "" && e.AggregateID == "" {
		return 0, 0, false, nil
	}
	err = db.QueryRow(ctx, s.earlier, e.Group, string(e.Kind), CleanText(e.AggregateType), CleanText(e.AggregateID), e.AggregateVersion, e.ID).Scan(&id, &version)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, 0, false, nil
	}
	if err != nil {
		return 0, 0, false, fmt.Errorf("look for held events before held event %d: %w", e.ID, err)
	}
	return id, version, true, nil
}

// Aggregate names one aggregate.
type Aggregate struct{ Type, ID string }

// LateAggregates returns up to limit of the group's aggregates with late
// events whose replay was requested and is due, those waiting longest
// first.
func (s *Store) LateAggregates(ctx context.Context, db DBTX, group string, limit int) ([]Aggregate, error) {
	rows, err := db.Query(ctx, s.lateAggregates, group, limit)
	if err != nil {
		return nil, fmt.Errorf("find late events to apply: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Aggregate, error) {
		var a Aggregate
		return a, row.Scan(&a.Type, &a.ID)
	})
	if err != nil {
		return nil, fmt.Errorf("find late events to apply: %w", err)
	}
	return out, nil
}

// LockLate locks, in tx (which holds the aggregate's lock), up to limit of
// the aggregate's late events whose replay was requested and is due, in
// version order.
func (s *Store) LockLate(ctx context.Context, tx pgx.Tx, group string, a Aggregate, limit int) ([]Event, error) {
	rows, err := tx.Query(ctx, s.lockLate, group, a.Type, a.ID, limit)
	if err != nil {
		return nil, fmt.Errorf("load late events of %s/%s: %w", a.Type, a.ID, err)
	}
	return collect(rows)
}

// MarkLateApplied records, in tx, that late event id was applied: it is
// replayed, and its dedup record's outcome is late_applied.
func (s *Store) MarkLateApplied(ctx context.Context, tx DBTX, id int64) error {
	if _, err := tx.Exec(ctx, s.lateApplied, id); err != nil {
		return fmt.Errorf("mark late event %d applied: %w", id, err)
	}
	return nil
}

// CountOpen returns how many events of kind the group holds open (held or
// replay requested); group "" counts the relay's.
func (s *Store) CountOpen(ctx context.Context, db DBTX, group string, kind Kind) (int64, error) {
	var n int64
	if err := db.QueryRow(ctx, s.countOpen, group, string(kind)).Scan(&n); err != nil {
		return 0, fmt.Errorf("count the held events (%s) of %q: %w", kind, group, err)
	}
	return n, nil
}

// AddRelay holds an outbox row the relay gave up on, in tx (the relay's
// transaction recording its progress). e's Shard, MessageUUID (the outbox
// row's uuid), Payload and Metadata are the row; Cause and Reason why;
// Attempts and LastError its publishes.
func (s *Store) AddRelay(ctx context.Context, tx DBTX, e Event) error {
	hk, hv := Headers(e.Metadata)
	_, err := tx.Exec(ctx, s.addRelay, e.Cause, CleanText(Truncate(e.Reason, maxReasonBytes)), e.Shard, []byte(e.MessageUUID),
		CleanText(e.EventID), CleanText(e.EventType), CleanText(e.AggregateType), CleanText(e.AggregateID), e.AggregateVersion,
		CleanText(e.Topic), payload(e.Payload), hk, hv, e.Attempts, CleanText(Truncate(e.LastError, maxReasonBytes)))
	if err != nil {
		return fmt.Errorf("write dead letter: %w", err)
	}
	return nil
}

// AddDeadLetter holds a message consumer group e.Group gave up on, through
// db (a pool: its own transaction; or a transaction, to commit it with
// other writes), and returns its id. It never fails because of the
// message's content: bytes are stored as bytea and text fields PostgreSQL
// cannot hold (NUL bytes, invalid UTF-8) are cleaned. A record from Kafka
// that already has a row (the same group, topic, partition and offset)
// re-opens that row.
func (s *Store) AddDeadLetter(ctx context.Context, db DBTX, e Event) (int64, error) {
	if e.Group == "" {
		return 0, errors.New("dead letter without a consumer group")
	}
	var partition *int32
	var offset *int64
	if e.FromKafka {
		partition, offset = &e.Partition, &e.Offset
	}
	cause := cmp.Or(CleanText(e.Cause), CauseFailed)
	hk, hv := Headers(e.Metadata)
	var id int64
	err := db.QueryRow(ctx, s.addDeadLetter, CleanText(e.Group), CleanText(e.Topic), CleanText(e.Handler), partition, offset, e.Key,
		[]byte(e.MessageUUID), payload(e.Payload), hk, hv, CleanText(e.EventID), CleanText(e.EventType), CleanText(e.AggregateType),
		CleanText(e.AggregateID), e.AggregateVersion, e.PreviousVersion, cause, CleanText(Truncate(e.Reason, maxReasonBytes))).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("write dead letter of group %s: %w", e.Group, err)
	}
	return id, nil
}

// Headers returns metadata as the header_keys and header_values columns:
// sorted by key, bytes as they are.
func Headers(md map[string]string) (keys, values [][]byte) {
	ks := slices.Sorted(maps.Keys(md))
	keys, values = make([][]byte, len(ks)), make([][]byte, len(ks))
	for i, k := range ks {
		keys[i], values[i] = []byte(k), []byte(md[k])
	}
	return keys, values
}

func payload(p []byte) []byte {
	if p == nil {
		return []byte{}
	}
	return p
}

func collect(rows pgx.Rows) ([]Event, error) {
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Event, error) {
		var e Event
		var kind, status string
		var uuid []byte
		var hk, hv [][]byte
		var partition *int32
		var offset *int64
		var shard *int32
		err := row.Scan(&e.ID, &kind, &e.Cause, &e.Reason, &e.Group, &e.EventID, &e.EventType, &e.AggregateType, &e.AggregateID,
			&e.AggregateVersion, &e.PreviousVersion, &e.CurrentVersion, &e.Topic, &e.Handler, &uuid, &e.Payload, &hk, &hv,
			&partition, &offset, &e.Key, &shard, &e.HeldAt, &e.Times, &status, &e.ReplayRequestedAt, &e.ReplayedAt,
			&e.Attempts, &e.LastError, &e.LastAttemptAt, &e.NextAttemptAt, &e.DiscardedAt, &e.DiscardReason)
		if err != nil {
			return e, err
		}
		e.Kind, e.Status, e.MessageUUID = Kind(kind), Status(status), string(uuid)
		if e.Payload == nil {
			e.Payload = []byte{}
		}
		if partition != nil && offset != nil {
			e.FromKafka, e.Partition, e.Offset = true, *partition, *offset
		}
		if shard != nil {
			e.Shard = int(*shard)
		}
		e.Metadata = make(map[string]string, len(hk))
		for i := range hk {
			e.Metadata[string(hk[i])] = string(hv[i])
		}
		return e, nil
	})
	if err != nil {
		return nil, fmt.Errorf("read held events: %w", err)
	}
	return out, nil
}

// CleanText makes s storable in a text column: invalid UTF-8 and NUL bytes
// become U+FFFD.
func CleanText(s string) string {
	if utf8.ValidString(s) && strings.IndexByte(s, 0) < 0 {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// Truncate cuts s to at most n bytes, on a rune boundary, marking the cut
// with "…".
func Truncate(s string, n int) string {
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
