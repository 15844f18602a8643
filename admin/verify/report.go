package verify

import (
	"cmp"
	"slices"
	"time"
)

// Severity says whether a finding is a broken guarantee, something an
// operator should look at, or information.
type Severity string

// The severities, most serious first.
const (
	// Problem: a guarantee is broken or an event is stuck; Report.OK is
	// false.
	Problem Severity = "problem"
	// Warning: the pipeline gave up on something by policy (a skipped
	// gap). Report.OK stays true; a strict run treats it as a problem.
	Warning Severity = "warning"
	// Info: a normal transient state (a fresh pending or parked event).
	Info Severity = "info"
)

// Kind names what a finding is about. The values are stable: scripts read
// them from the JSON output.
type Kind string

// The kinds of finding.
const (
	// Pending: committed, not applied by the group yet; a problem (stuck)
	// once older than Config.MaxPendingAge.
	Pending Kind = "pending"
	// Lost: committed and relayed, never applied by the group, while the
	// group moved past it (its aggregate version, or its Kafka offset),
	// with no dedup record, no skipped range and no dead letter to explain
	// it; or relayed and not on Kafka.
	Lost Kind = "lost"
	// Discarded: the group discarded the event as stale because another
	// event, with another id, had been applied at its aggregate version:
	// two events claim one version, and this one's effect was never
	// applied.
	Discarded Kind = "discarded"
	// AppliedTwice: the group's effects query returned the event more than
	// once.
	AppliedTwice Kind = "applied_twice"
	// OutOfOrder: the group applied a version of an aggregate after a
	// higher one.
	OutOfOrder Kind = "out_of_order"
	// Parked: waiting in parked_events for a missing earlier version; a
	// problem once older than Config.MaxParkedAge.
	Parked Kind = "parked"
	// Skipped: versions the group gave up on (skipped_versions).
	Skipped Kind = "skipped"
	// DeadLetter: an event the relay (Group empty) or a consumer group
	// dead-lettered and nobody replayed.
	DeadLetter Kind = "dead_letter"
	// Late: an event held as late for the operator: it arrived after its
	// version was given up on, was passed while parked, could not be
	// released, or is a replayed dead letter whose version was taken
	// (eventline held list -kind late, held replay, held discard).
	Late Kind = "late"
)

// kindOrder is the order findings are listed in.
var kindOrder = map[Kind]int{Lost: 0, Discarded: 1, AppliedTwice: 2, OutOfOrder: 3, DeadLetter: 4, Pending: 5, Parked: 6, Skipped: 7, Late: 8}

// Finding is one event, aggregate or gap the check has something to say
// about.
type Finding struct {
	Severity Severity `json:"severity"`
	Kind     Kind     `json:"kind"`
	// Group is the consumer group; empty for the relay's dead letters.
	Group            string `json:"group,omitempty"`
	EventID          string `json:"event_id,omitempty"`
	EventType        string `json:"event_type,omitempty"`
	Topic            string `json:"topic,omitempty"`
	AggregateType    string `json:"aggregate_type,omitempty"`
	AggregateID      string `json:"aggregate_id,omitempty"`
	AggregateVersion int64  `json:"aggregate_version,omitempty"`
	// ToVersion ends a range of versions (skipped gaps).
	ToVersion int64 `json:"to_version,omitempty"`
	// At is when the event was committed (pending, lost), applied (out of
	// order), parked, skipped or dead-lettered.
	At *time.Time `json:"at,omitempty"`
	// AgeSeconds is the time since At.
	AgeSeconds float64 `json:"age_seconds,omitempty"`
	// Stage is where a pending event is: outbox, retrying, kafka, relayed.
	Stage string `json:"stage,omitempty"`
	// Detail explains the finding in a sentence, with the evidence.
	Detail string `json:"detail"`
}

// Omitted counts findings of one kind and group left out of the details
// (Config.MaxDetails).
type Omitted struct {
	Group    string   `json:"group,omitempty"`
	Kind     Kind     `json:"kind"`
	Severity Severity `json:"severity"`
	Count    int64    `json:"count"`
}

// Report is the result of Run. Its JSON form is for scripts; field names
// are stable.
type Report struct {
	CheckedAt      time.Time `json:"checked_at"`
	Schema         string    `json:"schema"`
	ConsumerSchema string    `json:"consumer_schema"`
	// SeparateConsumerDatabase is true when the consumer tables were read
	// from their own database.
	SeparateConsumerDatabase bool       `json:"separate_consumer_database"`
	Since                    *time.Time `json:"since"`
	Until                    *time.Time `json:"until"`
	// DedupHorizon is now minus the dedup retention: a missing dedup
	// record of an event committed before it proves nothing.
	DedupHorizon time.Time `json:"dedup_horizon"`
	// OK is false when any problem was found.
	OK       bool          `json:"ok"`
	Problems int64         `json:"problems"`
	Warnings int64         `json:"warnings"`
	Outbox   OutboxSummary `json:"outbox"`
	Kafka    KafkaSummary  `json:"kafka"`
	Groups   []GroupReport `json:"groups"`
	// Findings are the details, most serious first, each kind's oldest
	// first.
	Findings []Finding `json:"findings"`
	Omitted  []Omitted `json:"omitted"`
	// Notes say what could not be checked and why.
	Notes []string `json:"notes"`
}

// OutboxSummary describes the outbox rows in the window.
type OutboxSummary struct {
	Shards int `json:"shards"`
	// Events is the number of outbox rows written in the window.
	Events int64 `json:"events"`
	// Relayed counts rows the relays have moved past (published, or
	// dead-lettered).
	Relayed              int64   `json:"relayed"`
	Pending              int64   `json:"pending"`
	OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	// Retrying counts rows that failed to publish and wait for a retry.
	Retrying int64 `json:"retrying"`
	// DeadLetters counts the relay's dead letters in the window not yet
	// replayed.
	DeadLetters int64 `json:"dead_letters"`
}

// KafkaSummary describes what was read from Kafka.
type KafkaSummary struct {
	Checked bool           `json:"checked"`
	Topics  []TopicSummary `json:"topics"`
}

// TopicSummary describes one topic as read.
type TopicSummary struct {
	Topic      string `json:"topic"`
	Partitions int    `json:"partitions"`
	Records    int64  `json:"records"`
	// Duplicates counts records of an event id already seen on the topic
	// (a relay crash between Kafka's ack and the outbox position write
	// publishes again; consumers deduplicate).
	Duplicates int64 `json:"duplicates"`
	// RetentionHorizon is the newest timestamp among each partition's
	// first record, over partitions Kafka has deleted records from: an
	// event published before it may have been deleted by retention.
	RetentionHorizon *time.Time `json:"retention_horizon,omitempty"`
	// Compacted is true when cleanup.policy includes compact: absence of
	// an event proves nothing.
	Compacted bool `json:"compacted,omitempty"`
	// Missing is true when the topic does not exist.
	Missing bool `json:"missing,omitempty"`
}

// GroupReport is one consumer group's reconciliation.
type GroupReport struct {
	Group  string   `json:"group"`
	Topics []string `json:"topics"`
	// TopicsFrom says where Topics came from: config, kafka (committed
	// offsets), records (topics of events it has dedup records of), or
	// none.
	TopicsFrom string `json:"topics_from"`
	// Deduplicates is false for a group without dedup records: applied and
	// lost events cannot be told apart, so pending and lost are not
	// checked for it.
	Deduplicates bool `json:"deduplicates"`
	// Events is the number of outbox events in the window on its topics.
	Events int64 `json:"events"`
	// Outcomes counts those events by their processed_events outcome
	// (applied, stale, parked…).
	Outcomes map[string]int64 `json:"outcomes"`
	// Pending counts events not applied yet; Stuck those of them older
	// than Config.MaxPendingAge.
	Pending              int64   `json:"pending"`
	Stuck                int64   `json:"stuck"`
	OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	Lost                 int64   `json:"lost"`
	// Discarded counts events the group discarded as stale because
	// another event had been applied at their version (Kind Discarded).
	Discarded int64 `json:"discarded"`
	// Unverifiable counts events without a dedup record committed before
	// the dedup horizon, whose record retention may have deleted.
	Unverifiable int64 `json:"unverifiable"`
	// SkippedEvents counts events without a dedup record whose version is
	// in a skipped range.
	SkippedEvents int64 `json:"skipped_events"`
	// DeadLettered counts events without a dedup record that the relay or
	// this group dead-lettered.
	DeadLettered int64 `json:"dead_lettered"`
	OutOfOrder   int64 `json:"out_of_order"`
	// AppliedTwice is null when the group has no effects query.
	AppliedTwice        *int64  `json:"applied_twice"`
	Parked              int64   `json:"parked"`
	OldestParkedSeconds float64 `json:"oldest_parked_seconds"`
	SkippedGaps         int64   `json:"skipped_gaps"`
	SkippedVersions     int64   `json:"skipped_versions"`
	// ConsumerDeadLetters counts the group's dead letters not replayed,
	// from the sources named in DeadLetterSources.
	ConsumerDeadLetters int64    `json:"consumer_dead_letters"`
	DeadLetterSources   []string `json:"dead_letter_sources"`
	// LateHeld counts the group's late events held for the operator.
	LateHeld int64 `json:"late_held"`
}

// finish sorts the findings and sets OK.
func (r *Report) finish() {
	sev := map[Severity]int{Problem: 0, Warning: 1, Info: 2}
	slices.SortStableFunc(r.Findings, func(a, b Finding) int {
		return cmp.Or(
			cmp.Compare(sev[a.Severity], sev[b.Severity]),
			cmp.Compare(kindOrder[a.Kind], kindOrder[b.Kind]),
			cmp.Compare(a.Group, b.Group),
			-cmp.Compare(a.AgeSeconds, b.AgeSeconds),
			cmp.Compare(a.AggregateType, b.AggregateType),
			cmp.Compare(a.AggregateID, b.AggregateID),
			cmp.Compare(a.AggregateVersion, b.AggregateVersion),
		)
	})
	slices.SortFunc(r.Omitted, func(a, b Omitted) int {
		return cmp.Or(cmp.Compare(sev[a.Severity], sev[b.Severity]), cmp.Compare(kindOrder[a.Kind], kindOrder[b.Kind]), cmp.Compare(a.Group, b.Group))
	})
	r.OK = r.Problems == 0
	// Empty lists are [] in the JSON, never null.
	r.Findings, r.Omitted, r.Notes = nonNil(r.Findings), nonNil(r.Omitted), nonNil(r.Notes)
	r.Groups, r.Kafka.Topics = nonNil(r.Groups), nonNil(r.Kafka.Topics)
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

// details keeps the oldest findings of each (group, kind, severity) up to a
// limit, and counts the rest, so memory stays bounded however many events
// are found.
type details struct {
	limit   int
	buckets map[detailKey]*bucket
}

type detailKey struct {
	group    string
	kind     Kind
	severity Severity
}

type bucket struct {
	kept    []Finding
	omitted int64
}

func newDetails(limit int) *details {
	return &details{limit: max(limit, 0), buckets: map[detailKey]*bucket{}}
}

// add records f; when its bucket is full, f replaces the youngest finding
// kept if it is older.
func (d *details) add(f Finding) {
	k := detailKey{f.Group, f.Kind, f.Severity}
	b := d.buckets[k]
	if b == nil {
		b = &bucket{}
		d.buckets[k] = b
	}
	if len(b.kept) < d.limit {
		b.kept = append(b.kept, f)
		return
	}
	b.omitted++
	if d.limit == 0 {
		return
	}
	youngest := 0 // limits are small: a scan does
	for i := range b.kept {
		if b.kept[i].AgeSeconds < b.kept[youngest].AgeSeconds {
			youngest = i
		}
	}
	if f.AgeSeconds > b.kept[youngest].AgeSeconds {
		b.kept[youngest] = f
	}
}

// into moves the kept findings and the omitted counts into r, and counts
// its problems and warnings.
func (d *details) into(r *Report) {
	for k, b := range d.buckets {
		switch n := int64(len(b.kept)) + b.omitted; k.severity {
		case Problem:
			r.Problems += n
		case Warning:
			r.Warnings += n
		}
		r.Findings = append(r.Findings, b.kept...)
		if b.omitted > 0 {
			r.Omitted = append(r.Omitted, Omitted{Group: k.group, Kind: k.kind, Severity: k.severity, Count: b.omitted})
		}
	}
}
