package producer

import (
	"strconv"
	"strings"
	"sync"

	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
)

// The publish statement does all of PublishTx's database work in one round
// trip:
//
//   - chk reads each aggregate's last version and topic (a plain read, no
//     lock) and decides whether the call conflicts: a topic other than the
//     recorded one, a supplied version that is not above the last one, or
//     one that skips versions when gaps are not allowed.
//   - seq, only when nothing conflicts, advances every aggregate's sequence
//     with one INSERT … ON CONFLICT DO UPDATE over the aggregates in
//     parameter order, that is (aggregate_type, aggregate_id) in byte order
//     (see plan.aggs): it locks the rows in that one ordered pass, as every
//     publish statement does, so concurrent calls cannot deadlock on each
//     other whatever mix of supplied and assigned versions they carry. An
//     aggregate without a supplied version advances by its event count
//     from whatever its row holds once locked. An aggregate with one
//     advances to its last supplied version, and only if its row still
//     holds the version chk read; a row whose topic changed to another one
//     since chk read it is not advanced either. Rows not advanced are not
//     returned: the call is stale.
//   - done and base, only when every aggregate advanced, hold each
//     aggregate's new last version and the version its events of this call
//     follow, in arrays indexed like the aggregate parameters (sorted in
//     byte order, as the client sorts them).
//   - o<shard> inserts the events into the outbox shard tables in
//     watermill-sql's format, each payload the forwarder envelope with the
//     versions spliced in, in call order; nothing when base is empty.
//   - the statement returns one row: per aggregate (parameter order) the
//     conflict status and the version and topic chk read, and the
//     aggregates seq advanced with their new versions.
//
// A conflict is reported, not raised, so the caller's transaction stays
// usable, and nothing was written. A stale call (another transaction
// changed a row between the statement's snapshot and its lock; that takes a
// supplied version, or a topic recorded concurrently) is undone and run
// again; see Producer.write.
const publishSQL = `WITH chk AS (
	SELECT a.k, a.t, a.i, a.n, a.first_sup, a.topic, s.version AS old, s.topic AS cur_topic,
		CASE
			WHEN s.topic <> a.topic THEN 3
			WHEN a.first_sup = 0 THEN 0
			WHEN coalesce(s.version, 0) + a.lead >= a.first_sup THEN 1
			WHEN NOT $8 AND coalesce(s.version, 0) + a.lead + 1 <> a.first_sup THEN 2
			ELSE 0
		END AS status,
		CASE WHEN a.first_sup = 0 THEN a.n ELSE a.last_v - coalesce(s.version, 0) END AS delta
	-- The planner must not see the arrays' lengths (hence the OFFSET 0
	-- subquery): then the plans it makes for the first executions cost the
	-- same as the generic plan, which PostgreSQL then keeps, instead of
	-- planning this statement anew on every call.
	FROM (SELECT $1::text[] AS t, $2::text[] AS i, $3::bigint[] AS n, $4::bigint[] AS lead, $5::bigint[] AS first_sup,
			$6::bigint[] AS last_v, $7::text[] AS topic OFFSET 0) p
	CROSS JOIN LATERAL unnest(p.t, p.i, p.n, p.lead, p.first_sup, p.last_v, p.topic)
		WITH ORDINALITY AS a(t, i, n, lead, first_sup, last_v, topic, k)
	-- OFFSET 0 keeps the lookup a per-aggregate index probe: pulled up into
	-- a join, a plan made while the table was small would scan it.
	LEFT JOIN LATERAL (SELECT version, topic FROM {schema}.aggregate_sequences WHERE aggregate_type = a.t AND aggregate_id = a.i OFFSET 0) s ON true
), seq AS (
	INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, version, topic)
	SELECT t, i, delta, topic FROM chk
	WHERE NOT EXISTS (SELECT 1 FROM chk WHERE status <> 0)
	ORDER BY k
	ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET version = s.version + excluded.version, topic = excluded.topic
	WHERE (s.topic IS NULL OR s.topic = excluded.topic)
		AND ((s.aggregate_type, s.aggregate_id) NOT IN (SELECT t, i FROM chk WHERE first_sup <> 0)
			OR (s.aggregate_type, s.aggregate_id, s.version) IN (SELECT t, i, old FROM chk WHERE first_sup <> 0 AND old IS NOT NULL))
	RETURNING aggregate_type AS t, aggregate_id AS i, version
), done AS (
	SELECT array_agg(version ORDER BY t COLLATE "C", i COLLATE "C") AS v FROM seq HAVING count(*) = cardinality($1::text[])
), base AS (
	SELECT array_agg(CASE WHEN c.first_sup = 0 THEN d.v[c.k] - c.n ELSE coalesce(c.old, 0) END ORDER BY c.k) AS b FROM chk c, done d
), ev AS (
	SELECT e.shard, e.ord, e.head, e.mid, e.tail,
		CASE WHEN e.v > 0 THEN e.v ELSE b.b[e.k] + e.rel END AS ver,
		CASE WHEN e.p >= 0 THEN e.p ELSE b.b[e.k] + e.rel - 1 END AS prev
	FROM base b,
		(SELECT $9::int[] AS k, $10::bigint[] AS rel, $11::bigint[] AS v, $12::bigint[] AS p, $13::int[] AS shard,
			$14::text[] AS head, $15::text[] AS mid, $16::text[] AS tail OFFSET 0) x,
		unnest(x.k, x.rel, x.v, x.p, x.shard, x.head, x.mid, x.tail) WITH ORDINALITY AS e(k, rel, v, p, shard, head, mid, tail, ord)
	WHERE b.b IS NOT NULL
){shard_inserts}
SELECT c.status, c.old, c.cur_topic, q.t, q.i, q.v
FROM (SELECT array_agg(status ORDER BY k) AS status, array_agg(old ORDER BY k) AS old, array_agg(cur_topic ORDER BY k) AS cur_topic FROM chk) c,
	(SELECT array_agg(t) AS t, array_agg(i) AS i, array_agg(version) AS v FROM seq) q`

// publishShardSQL inserts a shard's events (watermill-sql's columns; the
// payload is the forwarder envelope, the metadata column an empty object,
// as forwarder.Publisher writes them).
const publishShardSQL = `, o{shard} AS (
	INSERT INTO {messages} (uuid, payload, metadata, transaction_id)
	SELECT gen_random_uuid()::text,
		(head || CASE WHEN prev <> ver - 1 THEN '"` + `aggregate_previous_version` + `":"' || prev || '",' ELSE '' END || mid || ver || tail)::json,
		'{}', pg_current_xact_id()
	FROM ev WHERE shard = {shard} ORDER BY ord
)`

// undoSQL reverts what a stale publish statement wrote to the sequences:
// rows it created (v = 0) are deleted, rows it advanced get their version
// and topic back.
const undoSQL = `WITH r AS (
	SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[]) AS r(t, i, v, topic)
), d AS (
	DELETE FROM {schema}.aggregate_sequences s USING r WHERE r.v = 0 AND s.aggregate_type = r.t AND s.aggregate_id = r.i
)
UPDATE {schema}.aggregate_sequences s SET version = r.v, topic = r.topic FROM r WHERE r.v > 0 AND s.aggregate_type = r.t AND s.aggregate_id = r.i`

// publishAutoSQL is the publish statement for calls in which no event has a
// supplied version, the common case, doing less: the sequences are advanced
// by each aggregate's event count in one INSERT … ON CONFLICT DO UPDATE in
// the order of the parameters, as in publishSQL, without reading them
// first. An aggregate whose row records another topic, or none (a row from
// before topics were recorded), is not advanced and not returned; the call
// then falls back to publishSQL, which reports the conflict or records the
// topic. done holds the new versions in parameter order, and is empty
// unless every aggregate advanced (its check that RETURNING kept the
// insertion order guards the indexing below). The statement returns the
// advanced aggregates with their new versions, and whether done was
// filled, that is whether the events were written.
//
// Nothing here needs a sort: the function scans come in ordinality order,
// which the planner knows.
const publishAutoSQL = `WITH seq AS (
	INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, version, topic)
	SELECT a.t, a.i, a.n, a.topic
	FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[]) WITH ORDINALITY AS a(t, i, n, topic, k)
	ORDER BY a.k
	ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET version = s.version + excluded.version
	WHERE s.topic = excluded.topic
	RETURNING aggregate_type AS t, aggregate_id AS i, version
), done AS (
	SELECT array_agg(version) AS v FROM seq
	HAVING count(*) = cardinality($1::text[]) AND array_agg(t) = $1::text[] AND array_agg(i) = $2::text[]
){shard_inserts}
SELECT array_agg(t), array_agg(i), array_agg(version), EXISTS (SELECT 1 FROM done) FROM seq`

// publishAutoShardSQL inserts a shard's events for publishAutoSQL: an
// event's version is its aggregate's new last version, minus the
// aggregate's event count, plus the event's position among them.
const publishAutoShardSQL = `, o{shard} AS (
	INSERT INTO {messages} (uuid, payload, metadata, transaction_id)
	SELECT gen_random_uuid()::text, (e.head || ((SELECT v FROM done)[e.k] - ($3::bigint[])[e.k] + e.rel) || e.tail)::json, '{}', pg_current_xact_id()
	FROM unnest($5::int[], $6::bigint[], $7::int[], $8::text[], $9::text[]) WITH ORDINALITY AS e(k, rel, shard, head, tail, ord)
	WHERE e.shard = {shard} AND (SELECT v FROM done) IS NOT NULL
	ORDER BY e.ord
)`

// publishOneSQL publishes a call of one event without a supplied version,
// the most common call, with scalar parameters and nothing else: it
// advances the aggregate's sequence by one (creating it at 1) unless its
// row records another topic or none, and writes the event with that
// version. No row comes back when the sequence was not advanced, and then
// nothing was written: publishSQL handles the call.
const publishOneSQL = `WITH seq AS (
	INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, version, topic) VALUES ($1, $2, 1, $3)
	ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET version = s.version + 1
	WHERE s.topic = excluded.topic
	RETURNING version
), o AS (
	INSERT INTO {messages} (uuid, payload, metadata, transaction_id)
	SELECT gen_random_uuid()::text, ($4 || version || $5)::json, '{}', pg_current_xact_id() FROM seq
)
SELECT version FROM seq`

// publishOneCommitSQL is publishOneSQL for PublishAndCommit, where COMMIT
// travels behind it in the same round trip: it cannot answer "nothing
// written" with an empty result, since the COMMIT would then commit the
// caller's rows without the event. It records the topic of an aggregate
// whose row has none (a row from before topics were recorded), as
// publishSQL does, and fails when the row records another topic: then it
// divides by zero (SQLSTATE 22012, which nothing else in it can raise),
// PostgreSQL skips the COMMIT queued behind it, and PublishAndCommit rolls
// back and reports the conflict.
const publishOneCommitSQL = `WITH seq AS (
	INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, version, topic) VALUES ($1, $2, 1, $3)
	ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET version = s.version + 1, topic = excluded.topic
	WHERE s.topic = excluded.topic OR s.topic IS NULL
	RETURNING version
), o AS (
	INSERT INTO {messages} (uuid, payload, metadata, transaction_id)
	SELECT gen_random_uuid()::text, ($4 || version || $5)::json, '{}', pg_current_xact_id() FROM seq
)
SELECT (SELECT version FROM seq) + 0 / (SELECT count(*) FROM seq)`

// publishAutoCommitSQL is publishAutoSQL for PublishAndCommit, failing
// instead of writing nothing, like publishOneCommitSQL. It returns what
// publishAutoSQL returns.
const publishAutoCommitSQL = `WITH seq AS (
	INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, version, topic)
	SELECT a.t, a.i, a.n, a.topic
	FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[]) WITH ORDINALITY AS a(t, i, n, topic, k)
	ORDER BY a.k
	ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET version = s.version + excluded.version, topic = excluded.topic
	WHERE s.topic = excluded.topic OR s.topic IS NULL
	RETURNING aggregate_type AS t, aggregate_id AS i, version
), done AS (
	SELECT array_agg(version) AS v FROM seq
	HAVING count(*) = cardinality($1::text[]) AND array_agg(t) = $1::text[] AND array_agg(i) = $2::text[]
){shard_inserts}
SELECT array_agg(t), array_agg(i), array_agg(version), 0 / (SELECT count(*) FROM done) = 0 FROM seq`

// publishRowSQL writes one event whose versions are the caller's
// (Config.CallerVersionedTypes): its outbox row and nothing else, the
// payload complete ($1).
const publishRowSQL = `INSERT INTO {messages} (uuid, payload, metadata, transaction_id)
VALUES (gen_random_uuid()::text, $1::json, '{}', pg_current_xact_id())`

// publishRowsSQL writes events whose versions are the caller's: per shard
// (publishRowsShardSQL), the rows of the events of that shard ($1) with
// their complete payloads ($2), in call order.
const publishRowsSQL = `WITH p AS (SELECT 1){shard_inserts}
SELECT 1`

const publishRowsShardSQL = `, o{shard} AS (
	INSERT INTO {messages} (uuid, payload, metadata, transaction_id)
	SELECT gen_random_uuid()::text, e.body::json, '{}', pg_current_xact_id()
	FROM unnest($1::int[], $2::text[]) WITH ORDINALITY AS e(shard, body, ord)
	WHERE e.shard = {shard}
	ORDER BY e.ord
)`

// errNotWrittenCode is the SQLSTATE with which the statements of
// PublishAndCommit fail when they wrote nothing (division_by_zero).
const errNotWrittenCode = "22012"

// maxPublishAttempts bounds how often a stale publish statement is run
// again. Under read committed the second attempt cannot be stale (the first
// left every row locked); the bound only guards against surprises.
const maxPublishAttempts = 3

// Conflict statuses returned by the publish statement.
const (
	statusOK = iota
	statusStale
	statusGap
	statusTopic
)

// statement is a publish statement: its text and, for one that writes to
// several shards, the insert rendered into {shard_inserts} for each of them
// (empty for one whose {messages} is the one shard's table).
type statement struct{ name, sql, perShard string }

var (
	stmtPublish    = statement{"publish", publishSQL, publishShardSQL}
	stmtAuto       = statement{"auto", publishAutoSQL, publishAutoShardSQL}
	stmtAutoCommit = statement{"auto-commit", publishAutoCommitSQL, publishAutoShardSQL}
	stmtRows       = statement{"rows", publishRowsSQL, publishRowsShardSQL}
	stmtOne        = statement{"one", publishOneSQL, ""}
	stmtOneCommit  = statement{"one-commit", publishOneCommitSQL, ""}
	stmtRow        = statement{"row", publishRowSQL, ""}
)

// statements renders and caches the publish statements for each set of
// shards a call writes to.
type statements struct {
	schema string
	undo   string
	mu     sync.Mutex
	byKey  map[string]string
}

func newStatements(schema string) *statements {
	return &statements{schema: schema, undo: sqlident.SQL(schema, undoSQL), byKey: map[string]string{}}
}

// get returns st rendered for shards (ascending; for a single-shard
// statement, the first).
func (s *statements) get(st statement, shards []int) string {
	var key strings.Builder
	key.WriteString(st.name)
	for _, sh := range shards {
		key.WriteByte(':')
		key.WriteString(strconv.Itoa(sh))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if q, ok := s.byKey[key.String()]; ok {
		return q
	}
	if st.perShard == "" {
		q := outbox.SQL(s.schema, shards[0], st.sql)
		s.byKey[key.String()] = q
		return q
	}
	var inserts strings.Builder
	for _, sh := range shards {
		inserts.WriteString(outbox.SQL(s.schema, sh, st.perShard))
	}
	q := strings.Replace(sqlident.SQL(s.schema, st.sql), "{shard_inserts}", inserts.String(), 1)
	if len(s.byKey) < 4096 { // calls spanning many shards in many combinations are built anew
		s.byKey[key.String()] = q
	}
	return q
}
