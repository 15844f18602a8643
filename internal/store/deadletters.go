package store

import (
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

	"github.com/eventline/eventline/dedup"
)

// consumer_dead_letters: the messages a consumer group gave up on, kept
// whole in its own database.

// DeadLetterStatus is where a dead letter is in its life.
type DeadLetterStatus string

// The statuses of a dead letter.
const (
	// StatusDead: waiting for an operator.
	StatusDead DeadLetterStatus = "dead"
	// StatusReplayRequested: an operator asked for a replay; a running
	// consumer of the group picks it up.
	StatusReplayRequested DeadLetterStatus = "replay_requested"
	// StatusReplayed: replayed through the handler and committed (applied,
	// parked, or found a duplicate or stale by the gate).
	StatusReplayed DeadLetterStatus = "replayed"
	// StatusDiscarded: an operator gave up on it, with a reason.
	StatusDiscarded DeadLetterStatus = "discarded"
)

// Valid reports whether s is a known status.
func (s DeadLetterStatus) Valid() bool {
	return s == StatusDead || s == StatusReplayRequested || s == StatusReplayed || s == StatusDiscarded
}

// DeadLetter is a message a consumer group gave up on, kept whole in its
// own database: no size limit, no broker that can refuse it, and every
// byte of its payload and headers as received.
type DeadLetter struct {
	// ID orders dead letters as they died.
	ID int64
	// Group is the consumer group that gave up.
	Group string
	// Topic is the topic the message came from; Handler the Watermill
	// handler it was delivered to (a replay runs it through that handler).
	Topic   string
	Handler string // see Topic
	// FromKafka is true when Partition, Offset and Key locate the record.
	// A record dead-lettered again (a redelivery after a crash) updates
	// its row instead of adding one.
	FromKafka bool
	Partition int32  // see FromKafka
	Offset    int64  // see FromKafka
	Key       []byte // see FromKafka
	// MessageUUID, Payload and Metadata are the message, byte for byte
	// (metadata may hold NUL bytes and invalid UTF-8: it is stored as
	// bytea).
	MessageUUID string
	Payload     []byte
	Metadata    map[string]string // see MessageUUID
	// EventID, EventType, AggregateType, AggregateID and AggregateVersion
	// come from the envelope when it decodes (or its fields are plain
	// text), for listing and ordering replays; empty (0) otherwise.
	EventID          string
	EventType        string // see EventID
	AggregateType    string // see EventID
	AggregateID      string // see EventID
	AggregateVersion int64  // see EventID
	// Kind classifies the reason (dedup.KindPermanent,
	// dedup.KindRetriesExhausted…);
	// Reason is the error, in full (up to 8 KiB).
	Kind   string
	Reason string // see Kind
	// DeadAt is when it died (last, when it died more than once); Times
	// counts how often.
	DeadAt time.Time
	Times  int // see DeadAt
	// Status and the fields after it record what operators did.
	Status            DeadLetterStatus
	ReplayRequestedAt *time.Time // see Status
	ReplayedAt        *time.Time // see Status
	ReplayAttempts    int        // see Status
	LastReplayError   string     // see Status
	DiscardedAt       *time.Time // see Status
	DiscardReason     string     // see Status
}

// Message rebuilds the message as it was received.
func (d DeadLetter) Message() *message.Message {
	msg := message.NewMessage(d.MessageUUID, append([]byte{}, d.Payload...))
	for k, v := range d.Metadata {
		msg.Metadata.Set(k, v)
	}
	return msg
}

// DeadLetterFilter selects dead letters. Empty fields match everything.
// Group, AggregateType and AggregateID are compared as stored: NUL bytes
// and invalid UTF-8 become U+FFFD on both sides.
type DeadLetterFilter struct {
	// Group, AggregateType and AggregateID select exact values.
	Group         string
	AggregateType string // see Group
	AggregateID   string // see Group
	// IDs, when set, selects these dead letters only.
	IDs []int64
	// Statuses, when set, selects these statuses only; List defaults to
	// the unresolved ones (dead and replay_requested).
	Statuses []DeadLetterStatus
	// Limit caps List. Defaults to 100.
	Limit int
}

// ErrNoDeadLetters is returned by RequestReplay and Discard when no dead
// letter matched.
var ErrNoDeadLetters = errors.New("eventline: no consumer dead letter matched")

// maxReasonBytes bounds a stored reason (a panic's stack can be long).
const maxReasonBytes = 8 << 10

// deadLetterCols are the columns collectDeadLetters scans.
const deadLetterCols = `id, consumer_group, topic, handler, kafka_partition, kafka_offset, kafka_key, message_uuid, payload, header_keys, header_values,
	event_id, event_type, aggregate_type, aggregate_id, aggregate_version, kind, reason, dead_at, times_dead,
	status, replay_requested_at, replayed_at, replay_attempts, coalesce(last_replay_error, ''), discarded_at, coalesce(discard_reason, '')`

// deadLetterFilter is the condition a DeadLetterFilter becomes ($1 group,
// $2 aggregate type, $3 aggregate id, $4 ids, $5 statuses).
const deadLetterFilter = `($1 = '' OR consumer_group = $1) AND ($2 = '' OR aggregate_type = $2) AND ($3 = '' OR aggregate_id = $3)
	AND (cardinality($4::bigint[]) = 0 OR id = ANY($4)) AND status = ANY($5)`

var (
	// A record dead-lettered again (redelivered after a crash, or failing
	// again after a replay) re-opens its row, with the new reason; the
	// record itself is the same.
	addDeadLetterSQL = statement(`INSERT INTO {schema}.consumer_dead_letters AS d (consumer_group, topic, handler, kafka_partition, kafka_offset,
			kafka_key, message_uuid, payload, header_keys, header_values, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, kind, reason)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)
		ON CONFLICT (consumer_group, topic, kafka_partition, kafka_offset) DO UPDATE
		SET kind = excluded.kind, reason = excluded.reason, dead_at = now(), times_dead = d.times_dead + 1, status = 'dead'
		RETURNING id`)
	listDeadLettersSQL = statement(`SELECT ` + deadLetterCols + ` FROM {schema}.consumer_dead_letters WHERE ` + deadLetterFilter + `
		ORDER BY id LIMIT $6`)
	// Replays go per aggregate in version order, then in the order the
	// records arrived.
	claimReplaysSQL = statement(`SELECT ` + deadLetterCols + ` FROM {schema}.consumer_dead_letters
		WHERE consumer_group = $1 AND status = 'replay_requested'
		ORDER BY aggregate_type, aggregate_id, aggregate_version, kafka_partition, kafka_offset, id
		LIMIT $2 FOR UPDATE SKIP LOCKED`)
	replayedSQL = statement(`UPDATE {schema}.consumer_dead_letters
		SET status = 'replayed', replayed_at = now(), replay_attempts = replay_attempts + 1, last_replay_error = NULL
		WHERE id = $1`)
	replayFailedSQL = statement(`UPDATE {schema}.consumer_dead_letters
		SET status = 'dead', replay_attempts = replay_attempts + 1, last_replay_error = $2
		WHERE id = $1`)
	requestReplaySQL = statement(`UPDATE {schema}.consumer_dead_letters SET status = 'replay_requested', replay_requested_at = now()
		WHERE ` + deadLetterFilter + ` RETURNING id`)
	discardDeadLettersSQL = statement(`UPDATE {schema}.consumer_dead_letters SET status = 'discarded', discarded_at = now(), discard_reason = $6
		WHERE ` + deadLetterFilter + ` RETURNING id`)
	countDeadLettersSQL = statement(`SELECT count(*) FROM {schema}.consumer_dead_letters
		WHERE consumer_group = $1 AND status IN ('dead', 'replay_requested')`)
	earlierDeadSQL = statement(`SELECT id, aggregate_version FROM {schema}.consumer_dead_letters
		WHERE consumer_group = $1 AND status = 'dead'
			AND aggregate_type = $2 AND aggregate_id = $3 AND (aggregate_version < $4 OR (aggregate_version = $4 AND id < $5))
		ORDER BY aggregate_version, id LIMIT 1`)
)

// AddDeadLetter stores a dead letter through db (a pool: its own transaction; or a
// transaction, to commit it with other writes) and returns its id. It
// never fails because of the message's content: bytes are stored as bytea
// and text fields that PostgreSQL cannot hold (NUL bytes, invalid UTF-8)
// are cleaned. A record from Kafka that already has a row (the same group,
// topic, partition and offset) re-opens that row.
func (s *Store) AddDeadLetter(ctx context.Context, db DBTX, d DeadLetter) (int64, error) {
	var partition *int32
	var offset *int64
	if d.FromKafka {
		partition, offset = &d.Partition, &d.Offset
	}
	keys := slices.Sorted(maps.Keys(d.Metadata))
	hk, hv := make([][]byte, len(keys)), make([][]byte, len(keys))
	for i, k := range keys {
		hk[i], hv[i] = []byte(k), []byte(d.Metadata[k])
	}
	payload := d.Payload
	if payload == nil {
		payload = []byte{}
	}
	kind := cleanText(d.Kind)
	if kind == "" {
		kind = dedup.KindFailed
	}
	var id int64
	err := db.QueryRow(ctx, s.q(addDeadLetterSQL), cleanText(d.Group), cleanText(d.Topic), cleanText(d.Handler), partition, offset, d.Key,
		[]byte(d.MessageUUID), payload, hk, hv, cleanText(d.EventID), cleanText(d.EventType), cleanText(d.AggregateType),
		cleanText(d.AggregateID), d.AggregateVersion, kind, cleanText(truncate(d.Reason, maxReasonBytes))).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("eventline: write dead letter of group %s: %w", d.Group, err)
	}
	return id, nil
}

func deadLetterArgs(f DeadLetterFilter, defaults ...DeadLetterStatus) []any {
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
		ids = []int64{}
	}
	// Stored text is cleaned (see Add): clean the filter the same way, so
	// a hostile record is found by the group and aggregate it claimed.
	return []any{cleanText(f.Group), cleanText(f.AggregateType), cleanText(f.AggregateID), ids, st}
}

// ListDeadLetters returns dead letters in the order they died (unresolved
// ones unless f.Statuses says otherwise).
func (s *Store) ListDeadLetters(ctx context.Context, db DBTX, f DeadLetterFilter) ([]DeadLetter, error) {
	if f.Limit <= 0 {
		f.Limit = DefaultListLimit
	}
	rows, err := db.Query(ctx, s.q(listDeadLettersSQL), append(deadLetterArgs(f, StatusDead, StatusReplayRequested), f.Limit)...)
	if err != nil {
		return nil, fmt.Errorf("eventline: list dead letters: %w", err)
	}
	return collectDeadLetters(rows)
}

// RequestReplay marks the dead letters f selects among those waiting
// (status dead) for replay, and returns their ids. A running consumer of
// each one's group replays them on its next sweep, in order: per
// aggregate by version, then as they arrived. It returns ErrNoDeadLetters
// when nothing matched.
func (s *Store) RequestReplay(ctx context.Context, db DBTX, f DeadLetterFilter) ([]int64, error) {
	f.Statuses = []DeadLetterStatus{StatusDead}
	return s.updateDeadLetters(ctx, db, requestReplaySQL, "request replay of", deadLetterArgs(f))
}

// DiscardDeadLetters gives up on the dead letters f selects among the unresolved ones,
// recording reason, and returns their ids. It returns ErrNoDeadLetters
// when nothing matched.
func (s *Store) DiscardDeadLetters(ctx context.Context, db DBTX, f DeadLetterFilter, reason string) ([]int64, error) {
	if strings.TrimSpace(reason) == "" {
		return nil, errors.New("eventline: discarding a dead letter needs a reason: it is kept for the audit")
	}
	f.Statuses = []DeadLetterStatus{StatusDead, StatusReplayRequested}
	return s.updateDeadLetters(ctx, db, discardDeadLettersSQL, "discard", append(deadLetterArgs(f), cleanText(reason)))
}

func (s *Store) updateDeadLetters(ctx context.Context, db DBTX, st stmt, what string, args []any) ([]int64, error) {
	rows, err := db.Query(ctx, s.q(st), args...)
	if err != nil {
		return nil, fmt.Errorf("eventline: %s dead letters: %w", what, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("eventline: %s dead letters: %w", what, err)
	}
	if len(ids) == 0 {
		return nil, ErrNoDeadLetters
	}
	slices.Sort(ids)
	return ids, nil
}

// ClaimReplays locks, in tx, up to limit of the group's dead letters
// waiting for replay, in replay order, skipping those another replayer
// holds. Mark each with MarkReplayed or MarkReplayFailed in the same tx.
func (s *Store) ClaimReplays(ctx context.Context, tx pgx.Tx, group string, limit int) ([]DeadLetter, error) {
	rows, err := tx.Query(ctx, s.q(claimReplaysSQL), group, limit)
	if err != nil {
		return nil, fmt.Errorf("eventline: claim dead letters to replay: %w", err)
	}
	return collectDeadLetters(rows)
}

// MarkReplayed records that dead letter id was replayed and committed.
func (s *Store) MarkReplayed(ctx context.Context, db DBTX, id int64) error {
	if _, err := db.Exec(ctx, s.q(replayedSQL), id); err != nil {
		return fmt.Errorf("eventline: mark dead letter %d replayed: %w", id, err)
	}
	return nil
}

// MarkReplayFailed puts dead letter id back to dead with the replay's
// error.
func (s *Store) MarkReplayFailed(ctx context.Context, db DBTX, id int64, replayErr string) error {
	if _, err := db.Exec(ctx, s.q(replayFailedSQL), id, cleanText(truncate(replayErr, maxReasonBytes))); err != nil {
		return fmt.Errorf("eventline: record failed replay of dead letter %d: %w", id, err)
	}
	return nil
}

// EarlierDead returns the first dead letter of d's aggregate that comes
// before d in replay order and still waits for an operator (status dead),
// if any: replaying d before it would apply the aggregate's versions out of
// order. Dead letters without an aggregate have none.
func (s *Store) EarlierDead(ctx context.Context, db DBTX, d DeadLetter) (DeadLetter, bool, error) {
	if d.AggregateType == "" && d.AggregateID == "" {
		return DeadLetter{}, false, nil
	}
	var e DeadLetter
	err := db.QueryRow(ctx, s.q(earlierDeadSQL), d.Group, cleanText(d.AggregateType), cleanText(d.AggregateID), d.AggregateVersion, d.ID).Scan(&e.ID, &e.AggregateVersion)
	if errors.Is(err, pgx.ErrNoRows) {
		return DeadLetter{}, false, nil
	}
	if err != nil {
		return DeadLetter{}, false, fmt.Errorf("eventline: look for earlier dead letters of dead letter %d: %w", d.ID, err)
	}
	return e, true, nil
}

// CountDeadLetters returns how many of the group's dead letters wait for
// an operator or for their replay.
func (s *Store) CountDeadLetters(ctx context.Context, db DBTX, group string) (int64, error) {
	var n int64
	if err := db.QueryRow(ctx, s.q(countDeadLettersSQL), group).Scan(&n); err != nil {
		return 0, fmt.Errorf("eventline: count dead letters of %q: %w", group, err)
	}
	return n, nil
}

func collectDeadLetters(rows pgx.Rows) ([]DeadLetter, error) {
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadLetter, error) {
		var d DeadLetter
		var partition *int32
		var offset *int64
		var uuid []byte
		var hk, hv [][]byte
		var status string
		err := r.Scan(&d.ID, &d.Group, &d.Topic, &d.Handler, &partition, &offset, &d.Key, &uuid, &d.Payload, &hk, &hv,
			&d.EventID, &d.EventType, &d.AggregateType, &d.AggregateID, &d.AggregateVersion, &d.Kind, &d.Reason, &d.DeadAt, &d.Times,
			&status, &d.ReplayRequestedAt, &d.ReplayedAt, &d.ReplayAttempts, &d.LastReplayError, &d.DiscardedAt, &d.DiscardReason)
		if err != nil {
			return d, err
		}
		if partition != nil && offset != nil {
			d.FromKafka, d.Partition, d.Offset = true, *partition, *offset
		}
		d.MessageUUID, d.Status = string(uuid), DeadLetterStatus(status)
		if len(hk) != len(hv) {
			return d, fmt.Errorf("dead letter %d: %d header keys but %d values", d.ID, len(hk), len(hv))
		}
		d.Metadata = make(map[string]string, len(hk))
		for i := range hk {
			d.Metadata[string(hk[i])] = string(hv[i])
		}
		if d.Payload == nil {
			d.Payload = []byte{}
		}
		return d, nil
	})
	if err != nil {
		return nil, fmt.Errorf("eventline: read dead letters: %w", err)
	}
	return out, nil
}

// cleanText makes s storable in a text column: invalid UTF-8 and NUL
// bytes become U+FFFD. (The exact bytes are kept in payload and headers.)
func cleanText(s string) string {
	if utf8.ValidString(s) && !strings.ContainsRune(s, 0) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// truncate cuts s to n bytes (cleanText repairs a rune cut in half).
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
