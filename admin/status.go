package admin

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
)

// Status is what `eventline status` shows: the outbox, the relays owning
// its shards, and every consumer group whose tables are in the schema.
type Status struct {
	Outbox OutboxStatus
	// Owners maps each shard with an unexpired lease to the relay holding
	// it (see ShardOwners); shards no relay owns are absent.
	Owners map[int]ShardOwner
	// Groups are the consumer groups that recorded anything, by name.
	Groups []GroupStatus
}

// GroupStatus is one consumer group: its gap and stall picture (parked
// events, open gaps, late events and dead letters held), its dedup records
// and every gap it skipped.
type GroupStatus struct {
	Group string
	// Parked counts parked events; OldestParked is the age of the oldest
	// (0 when none).
	Parked       int64
	OldestParked time.Duration
	// OpenGapCount counts aggregates whose lowest parked event waits for
	// missing versions; OpenGaps lists the oldest of them (see ReadStatus)
	// and OldestGap is the age of the oldest.
	OpenGapCount int64
	OpenGaps     []OpenGap
	OldestGap    time.Duration
	// SkippedGapsRecent counts the gaps recorded in skipped_versions in
	// the last 24 hours, by the sweeper, the Apply policy, a give-up or an
	// operator.
	SkippedGapsRecent int64
	// LateHeld counts the group's late events held for the operator, and
	// DeadLetters its dead letters, not yet replayed or discarded (held
	// events of kind late and dead_letter, status held or
	// replay_requested).
	LateHeld    int64
	DeadLetters int64 // see LateHeld
	// Processed counts the group's dedup records (processed_events rows).
	Processed int64
	// SkippedGaps and SkippedVersions count the gaps the group gave up on
	// (skipped_versions), ever, and the versions in them.
	SkippedGaps, SkippedVersions int64
}

// OpenGap is an aggregate whose lowest parked event waits for versions
// that have not arrived: its consumer group is stuck on it.
type OpenGap struct {
	AggregateType string
	AggregateID   string
	// Current is the aggregate's last applied version; the missing
	// versions are Current+1 up to Follows.
	Current int64
	// Follows is the predecessor the lowest parked event (Version) waits
	// for.
	Follows int64
	Version int64 // see Follows
	// Parked counts the aggregate's parked events.
	Parked int64
	// Age is how long the gap has been known: since the aggregate's
	// oldest parked event parked.
	Age time.Duration
}

// ReadStatus reads the outbox's status (ReadOutboxStatus), its shard
// owners and every consumer group's status from schema. It changes
// nothing; run it in a read-only repeatable-read transaction for one
// snapshot (as `eventline status` does). A schema without an outbox, or
// without the tables of later migrations, is an error wrapping
// producer.ErrNotMigrated.
//
// Open gaps are listed up to openGaps per group (the oldest first; all
// are counted); 0 lists 20, negative none.
func ReadStatus(ctx context.Context, db DBTX, schema string, openGaps int) (Status, error) {
	if err := checkArgs("ReadStatus", db, schema); err != nil {
		return Status{}, err
	}
	var st Status
	var err error
	if st.Outbox, err = ReadOutboxStatus(ctx, db, schema); err != nil {
		return st, err
	}
	// A schema rolled back part of the way (`eventline migrate down
	// -steps`) is refused as not migrated: held_events, the newest table,
	// comes with every consumer table before it. Asked first: a failed
	// statement would abort the caller's transaction.
	if err := outbox.CheckRelayTables(ctx, db, schema); err != nil {
		return st, err
	}
	if st.Owners, err = shardOwners(ctx, db, schema); err != nil {
		return st, err
	}
	gs, err := store.New(schema)
	if err != nil {
		return st, err
	}
	st.Groups, err = readGroups(ctx, db, schema, gs, openGaps, true)
	return st, err
}

// defaultOpenGaps is how many open gaps ReadStatus lists per group when
// asked for 0.
const defaultOpenGaps = 20

// openHeldSQL counts group $1's open held events of one kind.
func openHeldSQL(kind string) string {
	return `(SELECT count(*) FROM {schema}.held_events WHERE consumer_group = $1 AND kind = '` + kind + `' AND status IN ('held', 'replay_requested'))`
}

// groupCountsSQL counts a group's parked events, the oldest one's age in
// seconds, the gaps it skipped in the last 24 hours, and its open late
// events and dead letters ($1 group).
var groupCountsSQL = `SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(parked_at)), 0)::float8,
			(SELECT count(*) FROM {schema}.skipped_versions WHERE consumer_group = $1 AND skipped_at > now() - interval '24 hours'),
			` + openHeldSQL("late") + `, ` + openHeldSQL("dead_letter") + `
		FROM {schema}.parked_events WHERE consumer_group = $1`

// groupTotalsSQL counts group $1's dedup records, the gaps it skipped
// and the versions in them.
const groupTotalsSQL = `SELECT (SELECT count(*) FROM {schema}.processed_events WHERE consumer_group = $1),
		count(*), COALESCE(sum(to_version - from_version + 1), 0)::bigint
	FROM {schema}.skipped_versions WHERE consumer_group = $1`

// openGapsSQL reads, per aggregate with parked events, the lowest one,
// the predecessor it waits for and the aggregate's version; a gap is open
// when that predecessor has not been applied ($1 group, $2 limit). The
// last column counts the group's open gaps.
const openGapsSQL = `SELECT aggregate_type, aggregate_id, current, follows, head, n, age, count(*) OVER () FROM (
		SELECT p.aggregate_type, p.aggregate_id, COALESCE(av.version, 0) AS current, p.follows, p.head, p.n,
			EXTRACT(EPOCH FROM now() - p.oldest)::float8 AS age, p.oldest
		FROM (SELECT aggregate_type, aggregate_id, min(aggregate_version) AS head, count(*) AS n, min(parked_at) AS oldest,
				(array_agg(previous_version ORDER BY aggregate_version))[1] AS follows
			FROM {schema}.parked_events WHERE consumer_group = $1 GROUP BY aggregate_type, aggregate_id) p
		LEFT JOIN {schema}.aggregate_versions av ON av.consumer_group = $1 AND av.aggregate_type = p.aggregate_type AND av.aggregate_id = p.aggregate_id
		WHERE p.follows > COALESCE(av.version, 0)
	) g ORDER BY oldest, aggregate_type, aggregate_id LIMIT greatest($2::bigint, 1)`

// readGroups reads the status of every consumer group that recorded a
// version or a parked event or holds an open late event or dead letter,
// by name, listing up to openGaps open gaps each (as ReadStatus takes
// it). With totals it adds the groups with only dedup records and reads
// every group's dedup records and skipped gaps (ReadStatus; the collector
// reads without).
func readGroups(ctx context.Context, db DBTX, schema string, st *store.Store, openGaps int, totals bool) ([]GroupStatus, error) {
	names, err := st.StatusGroups(ctx, db)
	if err != nil {
		return nil, err
	}
	out := make([]GroupStatus, 0, len(names))
	for _, name := range names {
		g, err := readGroup(ctx, db, schema, name, openGaps)
		if err != nil {
			return nil, err
		}
		out = append(out, g)
	}
	if !totals {
		return out, nil
	}
	processed, err := st.ProcessedGroups(ctx, db)
	if err != nil {
		return nil, err
	}
	for _, name := range processed {
		if !slices.Contains(names, name) {
			out = append(out, GroupStatus{Group: name, OpenGaps: []OpenGap{}})
		}
	}
	slices.SortFunc(out, func(a, b GroupStatus) int { return strings.Compare(a.Group, b.Group) })
	for i := range out {
		g := &out[i]
		err := db.QueryRow(ctx, sqlident.SQL(schema, groupTotalsSQL), g.Group).Scan(&g.Processed, &g.SkippedGaps, &g.SkippedVersions)
		if err != nil {
			return nil, fmt.Errorf("eventline: count the dedup records and skipped gaps of group %q: %w", g.Group, err)
		}
	}
	return out, nil
}

// readGroup reads the group's parked events, open gaps, recently skipped
// gaps, held late events and unresolved dead letters.
func readGroup(ctx context.Context, db DBTX, schema, group string, openGaps int) (GroupStatus, error) {
	g := GroupStatus{Group: group, OpenGaps: []OpenGap{}}
	var oldest float64
	err := db.QueryRow(ctx, sqlident.SQL(schema, groupCountsSQL), group).Scan(&g.Parked, &oldest, &g.SkippedGapsRecent, &g.LateHeld, &g.DeadLetters)
	if err != nil {
		return g, fmt.Errorf("eventline: read the status of group %q: %w", group, err)
	}
	g.OldestParked = seconds(oldest)
	if g.Parked == 0 {
		return g, nil
	}
	openGaps = cmp.Or(openGaps, defaultOpenGaps)
	var o OpenGap
	var age float64
	rows, err := db.Query(ctx, sqlident.SQL(schema, openGapsSQL), group, openGaps)
	if err == nil {
		_, err = pgx.ForEachRow(rows, []any{&o.AggregateType, &o.AggregateID, &o.Current, &o.Follows, &o.Version, &o.Parked, &age, &g.OpenGapCount}, func() error {
			o.Age = seconds(age)
			g.OldestGap = max(g.OldestGap, o.Age)
			if openGaps > 0 {
				g.OpenGaps = append(g.OpenGaps, o)
			}
			return nil
		})
	}
	if err != nil {
		return g, fmt.Errorf("eventline: read the open gaps of group %q: %w", group, err)
	}
	return g, nil
}

// seconds is a non-negative number of seconds as a duration.
func seconds(s float64) time.Duration { return time.Duration(max(s, 0) * float64(time.Second)) }

// OutboxStatus is a snapshot of the outbox read from the database.
type OutboxStatus struct {
	Shards []ShardStatus
	// DeadLetters counts the relay's dead letters waiting for an operator
	// (held events of kind relay_dead_letter, status held).
	DeadLetters int64
	// Retrying counts rows that failed to publish and wait for a retry.
	Retrying int64
	// HorizonHolder is the oldest open transaction holding a transaction
	// id, which keeps committed rows from the relays, when some shard has
	// rows held back (HeldBack); nil otherwise.
	HorizonHolder *HorizonHolder
}

// Backlog sums the shards' backlogs.
func (s OutboxStatus) Backlog() int64 {
	var n int64
	for _, sh := range s.Shards {
		n += sh.Backlog
	}
	return n
}

// OldestPending is the oldest pending age over all shards.
func (s OutboxStatus) OldestPending() time.Duration {
	var d time.Duration
	for _, sh := range s.Shards {
		d = max(d, sh.OldestPending)
	}
	return d
}

// ShardStatus describes one outbox shard.
type ShardStatus struct {
	Shard int
	// Backlog is the number of committed rows the relays have not
	// forwarded yet.
	Backlog int64
	// OldestPending is the age of the oldest of them; zero when none.
	OldestPending time.Duration
	// Stored is the number of rows in the table, forwarded or not.
	Stored int64
	// PositionAhead is set when the shard's position or rows carry
	// transaction ids this cluster has not handed out: the outbox was moved
	// from another cluster and nothing is relayed until RebasePositions
	// (`eventline relay rebase-positions`) runs.
	PositionAhead bool
	// HeldBack counts committed rows of the backlog that relays cannot read
	// yet because an older transaction is still open (the xmin horizon):
	// see OutboxStatus.HorizonHolder.
	HeldBack int64
}

// HorizonHolder describes the transaction holding PostgreSQL's xmin
// horizon: the relays read only rows of transactions older than every open
// one, so while it stays open, newer committed events wait. End it (commit,
// roll back, or pg_terminate_backend(PID)) and they flow again. Its fields
// are documented on the type it names.
type HorizonHolder = outbox.HorizonHolder

// ReadHorizonHolder returns the oldest transaction holding a transaction
// id in the cluster, or nil when there is none.
func ReadHorizonHolder(ctx context.Context, db DBTX) (*HorizonHolder, error) {
	if err := checkDB("ReadHorizonHolder", "db", db); err != nil {
		return nil, err
	}
	return outbox.ReadHorizonHolder(ctx, db)
}

// shardStatusSQL reads one shard's backlog ($1 the relays' consumer
// group), the oldest pending row's age, the rows stored and the backlog's
// rows held back by the xmin horizon.
const shardStatusSQL = `SELECT count(*) FILTER (WHERE pending), COALESCE(EXTRACT(EPOCH FROM LOCALTIMESTAMP - min(created_at) FILTER (WHERE pending)), 0),
		count(*), count(*) FILTER (WHERE pending AND transaction_id >= pg_snapshot_xmin(pg_current_snapshot()))
	FROM (SELECT m.created_at, m.transaction_id,
			o.consumer_group IS NULL OR (m.transaction_id, m."offset") > (o.last_processed_transaction_id, o.offset_acked) AS pending
		FROM {messages} m LEFT JOIN {offsets} o ON o.consumer_group = $1) r`

// relayBacklogSQL counts the rows waiting for a retry and the relay's
// dead letters waiting for an operator.
const relayBacklogSQL = `SELECT (SELECT count(*) FROM {schema}.relay_failures),
		(SELECT count(*) FROM {schema}.held_events WHERE consumer_group = '' AND kind = 'relay_dead_letter' AND status = 'held')`

// ReadOutboxStatus reads the outbox's backlog per shard, the oldest
// pending age, and the dead letters and retries waiting. A schema without
// an outbox is an error wrapping producer.ErrNotMigrated.
func ReadOutboxStatus(ctx context.Context, db DBTX, schema string) (OutboxStatus, error) {
	if err := checkArgs("ReadOutboxStatus", db, schema); err != nil {
		return OutboxStatus{}, err
	}
	shards, err := outbox.ShardCount(ctx, db, schema)
	if err != nil {
		return OutboxStatus{}, err
	}
	var st OutboxStatus
	for shard := 0; shard < shards; shard++ {
		ss := ShardStatus{Shard: shard}
		var oldest float64
		err := db.QueryRow(ctx, outbox.SQL(schema, shard, shardStatusSQL), outbox.RelayConsumerGroup).
			Scan(&ss.Backlog, &oldest, &ss.Stored, &ss.HeldBack)
		if err != nil {
			return st, fmt.Errorf("read shard %d status: %w", shard, err)
		}
		ss.OldestPending = seconds(oldest)
		c, err := outbox.CheckPosition(ctx, db, schema, shard)
		if err != nil {
			return st, err
		}
		ss.PositionAhead = c.Ahead()
		if ss.PositionAhead {
			ss.HeldBack = 0 // not the horizon: see PositionAhead
		}
		st.Shards = append(st.Shards, ss)
		if ss.HeldBack > 0 && st.HorizonHolder == nil {
			if st.HorizonHolder, err = outbox.ReadHorizonHolder(ctx, db); err != nil {
				return st, err
			}
		}
	}
	// `eventline migrate down` reads the outbox before rolling back
	// 001_outbox, after 003_held_events is rolled back: then there are no
	// dead letters (asked first: a failed statement would abort the
	// caller's transaction).
	var hasHeld bool
	if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, sqlident.Qualify(schema, "held_events")).Scan(&hasHeld); err != nil {
		return st, fmt.Errorf("look for held_events: %w", err)
	}
	if !hasHeld {
		err = db.QueryRow(ctx, sqlident.SQL(schema, `SELECT count(*) FROM {schema}.relay_failures`)).Scan(&st.Retrying)
	} else {
		err = db.QueryRow(ctx, sqlident.SQL(schema, relayBacklogSQL)).Scan(&st.Retrying, &st.DeadLetters)
	}
	if err != nil {
		return st, fmt.Errorf("read dead letters: %w", err)
	}
	return st, nil
}

// ShardOwner is the relay holding a shard's lease.
type ShardOwner struct {
	// Relay is the owner's RelayConfig.ID.
	Relay string
	// Instance names the owner's Run: Relay plus a random suffix.
	Instance string
	// BackendPID is the PostgreSQL backend pid of the owner's ownership
	// connection (see pg_stat_activity for the client behind it).
	BackendPID int32
	// Epoch counts the shard's takeovers.
	Epoch int64
	// ExpiresIn is how long the lease lasts unless renewed.
	ExpiresIn time.Duration
}

// ShardOwners returns the shards with an unexpired lease and their
// owners. A schema without the relay's tables is an error wrapping
// ErrNotMigrated; no statement has failed
// then, so a transaction db stays usable.
func ShardOwners(ctx context.Context, db DBTX, schema string) (map[int]ShardOwner, error) {
	if err := checkArgs("ShardOwners", db, schema); err != nil {
		return nil, err
	}
	// Checked first: a failing query would abort the caller's transaction.
	if err := outbox.CheckRelayTables(ctx, db, schema); err != nil {
		return nil, err
	}
	return shardOwners(ctx, db, schema)
}

// shardOwnersSQL lists the unexpired leases with their owners.
const shardOwnersSQL = `SELECT l.shard, COALESCE(m.relay_id, ''), l.owner, COALESCE(m.backend_pid, 0), l.epoch,
		EXTRACT(EPOCH FROM l.expires_at - clock_timestamp())::float8
	FROM {schema}.relay_leases l
	LEFT JOIN {schema}.relay_members m ON m.instance = l.owner
	WHERE l.expires_at > clock_timestamp()`

func shardOwners(ctx context.Context, db DBTX, schema string) (map[int]ShardOwner, error) {
	var shard int
	var o ShardOwner
	var secs float64
	out := map[int]ShardOwner{}
	rows, err := db.Query(ctx, sqlident.SQL(schema, shardOwnersSQL))
	if err == nil {
		_, err = pgx.ForEachRow(rows, []any{&shard, &o.Relay, &o.Instance, &o.BackendPID, &o.Epoch, &secs}, func() error {
			o.ExpiresIn = seconds(secs)
			out[shard] = o
			return nil
		})
	}
	if err != nil {
		return nil, fmt.Errorf("read shard owners: %w", err)
	}
	return out, nil
}

// AggregateVersion names one version of one aggregate.
type AggregateVersion struct {
	AggregateType string
	AggregateID   string // see AggregateType
	Version       int64
}

// OutboxVersion is the newest outbox row of one aggregate version
// (FindOutboxVersions).
type OutboxVersion struct {
	AggregateVersion
	// Shard is the outbox shard holding the row; MessageUUID is the row's
	// uuid (a relay dead letter's HeldEvent.MessageUUID).
	Shard       int
	MessageUUID string
	// EventID and Topic come from the row's forwarder envelope (empty
	// when it does not decode); Committed is when the row was written.
	EventID   string
	Topic     string // see EventID
	Committed time.Time
	// Relayed is true when the relays' position is at or past the row:
	// it was published to Kafka (or dead-lettered by the relay).
	Relayed bool
}

// outboxVersionsSQL reads the newest outbox row of each aggregate version
// ($1 types, $2 ids, $3 versions as text) of one shard, and whether the
// relays' position ($4 their consumer group) is at or past it.
const outboxVersionsSQL = `SELECT DISTINCT ON (md.aggregate_type, md.aggregate_id, md.aggregate_version)
		md.aggregate_type, md.aggregate_id, md.aggregate_version, COALESCE(env.uuid, ''), COALESCE(env.destination_topic, ''), m.created_at::timestamptz,
		(o.consumer_group IS NOT NULL AND (m.transaction_id, m."offset") <= (o.last_processed_transaction_id, o.offset_acked)),
		m.uuid::text
	FROM {messages} m
	CROSS JOIN LATERAL json_to_record(CASE WHEN json_typeof(m.payload) = 'object' THEN m.payload ELSE '{}' END)
		AS env(uuid text, destination_topic text, metadata json)
	CROSS JOIN LATERAL json_to_record(CASE WHEN json_typeof(env.metadata) = 'object' THEN env.metadata ELSE '{}' END)
		AS md(aggregate_type text, aggregate_id text, aggregate_version text)
	LEFT JOIN {offsets} o ON o.consumer_group = $4
	WHERE (md.aggregate_type, md.aggregate_id, md.aggregate_version) IN (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]))
	ORDER BY md.aggregate_type, md.aggregate_id, md.aggregate_version, m.transaction_id DESC, m."offset" DESC`

// FindOutboxVersions returns the newest outbox row of each of versions
// that the outbox in schema holds (`eventline parked list` looks for the
// versions parked events wait for), searching each shard the aggregates
// hash to with one query. Versions without a row are absent. A schema
// without an outbox is an error wrapping producer.ErrNotMigrated.
func FindOutboxVersions(ctx context.Context, db DBTX, schema string, versions []AggregateVersion) ([]OutboxVersion, error) {
	if err := checkArgs("FindOutboxVersions", db, schema); err != nil {
		return nil, err
	}
	shards, err := outbox.ShardCount(ctx, db, schema)
	if err != nil {
		return nil, err
	}
	byShard := map[int][]AggregateVersion{}
	for _, v := range versions {
		s := outbox.ShardFor(v.AggregateType, v.AggregateID, shards)
		byShard[s] = append(byShard[s], v)
	}
	var out []OutboxVersion
	for _, shard := range slices.Sorted(maps.Keys(byShard)) {
		vs := byShard[shard]
		types, ids, nums := make([]string, len(vs)), make([]string, len(vs)), make([]string, len(vs))
		for i, v := range vs {
			types[i], ids[i], nums[i] = v.AggregateType, v.AggregateID, strconv.FormatInt(v.Version, 10)
		}
		rows, err := db.Query(ctx, outbox.SQL(schema, shard, outboxVersionsSQL), types, ids, nums, outbox.RelayConsumerGroup)
		if err != nil {
			return nil, fmt.Errorf("search outbox shard %d: %w", shard, err)
		}
		found, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (OutboxVersion, error) {
			ov := OutboxVersion{Shard: shard}
			var version string
			err := row.Scan(&ov.AggregateType, &ov.AggregateID, &version, &ov.EventID, &ov.Topic, &ov.Committed, &ov.Relayed, &ov.MessageUUID)
			ov.Version, _ = strconv.ParseInt(version, 10, 64)
			return ov, err
		})
		if err != nil {
			return nil, fmt.Errorf("search outbox shard %d: %w", shard, err)
		}
		out = append(out, found...)
	}
	return out, nil
}
