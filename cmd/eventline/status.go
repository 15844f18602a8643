package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/admin"
)

// statusReport is the output of `eventline status`; its JSON form is for
// scripts and keeps its field names stable.
type statusReport struct {
	Schema   string        `json:"schema"`
	Outbox   outboxReport  `json:"outbox"`
	Groups   []groupReport `json:"consumer_groups"`
	Warnings []string      `json:"warnings,omitempty"`
}

type outboxReport struct {
	Shards               []shardReport `json:"shards"`
	Backlog              int64         `json:"backlog"`
	OldestPendingSeconds float64       `json:"oldest_pending_seconds"`
	DeadLetters          int64         `json:"dead_letters"`
	Retrying             int64         `json:"retrying"`
	OwnedShards          int           `json:"owned_shards"`
	// HorizonHolder is the oldest open transaction, shown while it holds
	// committed events back from the relays; null otherwise.
	HorizonHolder *horizonHolderReport `json:"horizon_holder"`
}

type horizonHolderReport struct {
	PID             int32   `json:"pid"`
	Xid             string  `json:"xid"`
	BackendXmin     string  `json:"backend_xmin,omitempty"`
	XactAgeSeconds  float64 `json:"xact_age_seconds"`
	QueryStart      *string `json:"query_start"`
	State           string  `json:"state"`
	ApplicationName string  `json:"application_name"`
	Database        string  `json:"database"`
	Query           string  `json:"query,omitempty"`
	PreparedGID     string  `json:"prepared_gid,omitempty"`
}

type shardReport struct {
	Shard                int     `json:"shard"`
	Backlog              int64   `json:"backlog"`
	OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	Stored               int64   `json:"stored"`
	// OwnerPID is the PostgreSQL backend pid of the ownership connection
	// of the relay holding the shard's lease (see pg_stat_activity); null
	// when no relay owns it.
	OwnerPID *int32 `json:"owner_pid"`
	// Owner is that relay's ID; empty when no relay owns the shard.
	Owner string `json:"owner,omitempty"`
	// LeaseExpiresInSeconds is how long the owner's lease lasts unless
	// renewed (every rebalance interval).
	LeaseExpiresInSeconds float64 `json:"lease_expires_in_seconds,omitempty"`
	// PositionAhead is true when the shard's position or rows carry
	// transaction ids this cluster has not handed out: nothing is relayed
	// until `eventline relay rebase-positions` runs.
	PositionAhead bool `json:"position_ahead"`
	// HeldBack counts backlog rows the relays cannot read yet because an
	// older transaction is open (see outbox.horizon_holder).
	HeldBack int64 `json:"held_back"`
	// HeldBackBy is the backend pid of that transaction (0 for a prepared
	// one) while the shard has rows held back; null otherwise.
	HeldBackBy *int32 `json:"held_back_by_pid"`
}

type groupReport struct {
	Group string `json:"group"`
	// Processed is the group's dedup table size (processed_events rows).
	Processed           int64   `json:"processed"`
	Parked              int64   `json:"parked"`
	OldestParkedSeconds float64 `json:"oldest_parked_seconds"`
	SkippedGaps         int64   `json:"skipped_gaps"`
	SkippedVersions     int64   `json:"skipped_versions"`
	// Gap and stall figures (admin.GroupStatus): aggregates whose
	// lowest parked event waits for missing versions, the oldest one's
	// age, the first of them (oldest first), gaps skipped in the last 24
	// hours, late events held and consumer dead letters not resolved.
	OpenGaps             int64           `json:"open_gaps"`
	OldestOpenGapSeconds float64         `json:"oldest_open_gap_seconds"`
	OpenGapList          []openGapReport `json:"open_gap_list"`
	SkippedGaps24h       int64           `json:"skipped_gaps_24h"`
	LateEvents           int64           `json:"late_events"`
	DeadLetters          int64           `json:"dead_letters"`
}

// openGapReport is one aggregate stuck behind missing versions.
type openGapReport struct {
	AggregateType string  `json:"aggregate_type"`
	AggregateID   string  `json:"aggregate_id"`
	Current       int64   `json:"current_version"`
	MissingFrom   int64   `json:"missing_from"`
	MissingTo     int64   `json:"missing_to"`
	Parked        int64   `json:"parked"`
	AgeSeconds    float64 `json:"age_seconds"`
}

const statusHelp = `
Shows the pipeline's state as stored in PostgreSQL: per outbox shard the
backlog (events not yet relayed), the oldest pending event's age and the relay
that owns it; dead letters and retrying rows; and per consumer group the dedup
table size, parked events (with the oldest one's age) and the gaps given up on.
When something is stuck, a "Gaps and stalls" section follows: per group the
open gaps (aggregates waiting for missing versions, oldest first, with their
age), the gaps skipped in the last 24 hours, late events held and dead letters
not resolved; per shard the transaction holding its events back (pid, age,
query start). It reads a consistent snapshot and changes nothing.`

func runStatus(ctx context.Context, inv *invocation) error {
	inv.jsonFlag("print JSON (stable field names, for scripts) instead of tables")
	if _, err := inv.parse(); err != nil {
		return err
	}
	pool, err := inv.pool(ctx)
	if err != nil {
		return err
	}
	var rep statusReport
	err = pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		rep, err = readStatus(ctx, tx, inv.globals.schema)
		return err
	})
	if err != nil {
		return err
	}
	return inv.output(rep, func(w io.Writer) error { return printStatus(w, rep) })
}

// readStatus gathers the report from admin.ReadStatus, in tx's snapshot.
func readStatus(ctx context.Context, tx pgx.Tx, schema string) (statusReport, error) {
	rep := statusReport{Schema: schema, Groups: []groupReport{}}
	st, err := admin.ReadStatus(ctx, tx, schema, statusOpenGaps)
	if err != nil {
		return rep, err
	}
	o := st.Outbox
	rep.Outbox = outboxReport{
		Shards:               make([]shardReport, 0, len(o.Shards)),
		Backlog:              o.Backlog(),
		OldestPendingSeconds: o.OldestPending().Seconds(),
		DeadLetters:          o.DeadLetters,
		Retrying:             o.Retrying,
		OwnedShards:          len(st.Owners),
	}
	for _, s := range o.Shards {
		sr := shardReport{Shard: s.Shard, Backlog: s.Backlog, OldestPendingSeconds: s.OldestPending.Seconds(), Stored: s.Stored,
			PositionAhead: s.PositionAhead, HeldBack: s.HeldBack}
		if s.PositionAhead {
			rep.Warnings = append(rep.Warnings, fmt.Sprintf("shard %d: %v; nothing on it is relayed: stop the relays and run `eventline relay rebase-positions`", s.Shard, admin.ErrPositionAhead))
		}
		if h := o.HorizonHolder; h != nil && s.HeldBack > 0 {
			pid := h.PID
			sr.HeldBackBy = &pid
		}
		if owner, ok := st.Owners[s.Shard]; ok {
			pid := owner.BackendPID
			sr.OwnerPID, sr.Owner, sr.LeaseExpiresInSeconds = &pid, owner.Relay, owner.ExpiresIn.Seconds()
		}
		rep.Outbox.Shards = append(rep.Outbox.Shards, sr)
	}
	if h := o.HorizonHolder; h != nil {
		hr := &horizonHolderReport{PID: h.PID, Xid: h.Xid, BackendXmin: h.BackendXmin, XactAgeSeconds: h.XactAge.Seconds(),
			State: h.State, ApplicationName: h.ApplicationName, Database: h.Database, Query: h.Query, PreparedGID: h.PreparedGID}
		if h.QueryStart != nil {
			qs := h.QueryStart.UTC().Format(time.RFC3339)
			hr.QueryStart = &qs
		}
		rep.Outbox.HorizonHolder = hr
		who := fmt.Sprintf("pid %d", h.PID)
		if h.PreparedGID != "" {
			who = fmt.Sprintf("prepared transaction %q", h.PreparedGID)
		}
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("committed events wait behind an open transaction (%s, %s, open %s%s, application %q, database %q): the relays read only rows older than every open transaction; end it (or terminate it: pg_terminate_backend(%d)) and they flow again",
			who, h.State, age(h.XactAge), queryStarted(hr.QueryStart), h.ApplicationName, h.Database, h.PID))
	}
	for _, g := range st.Groups {
		gr := groupReport{Group: g.Group, Processed: g.Processed, Parked: g.Parked, OldestParkedSeconds: g.OldestParked.Seconds(),
			SkippedGaps: g.SkippedGaps, SkippedVersions: g.SkippedVersions,
			OpenGaps: g.OpenGapCount, OldestOpenGapSeconds: g.OldestGap.Seconds(), OpenGapList: []openGapReport{},
			SkippedGaps24h: g.SkippedGapsRecent, LateEvents: g.LateHeld, DeadLetters: g.DeadLetters}
		for _, og := range g.OpenGaps {
			gr.OpenGapList = append(gr.OpenGapList, openGapReport{AggregateType: og.AggregateType, AggregateID: og.AggregateID,
				Current: og.Current, MissingFrom: og.Current + 1, MissingTo: og.Follows, Parked: og.Parked, AgeSeconds: og.Age.Seconds()})
		}
		rep.Groups = append(rep.Groups, gr)
	}
	return rep, nil
}

// printStatus writes the report as tables.
func printStatus(w io.Writer, rep statusReport) error {
	o := rep.Outbox
	fmt.Fprintf(w, "Outbox (schema %s): %s, backlog %d, oldest pending %s, %d of %d shards owned by a relay\n",
		rep.Schema, plural(int64(len(o.Shards)), "shard"), o.Backlog, age(seconds(o.OldestPendingSeconds)), o.OwnedShards, len(o.Shards))
	tw := newTable(w)
	row(tw, "SHARD", "BACKLOG", "HELD BACK", "OLDEST PENDING", "STORED", "OWNER")
	for _, s := range o.Shards {
		owner := "-"
		if s.OwnerPID != nil {
			owner = fmt.Sprintf("%s (pid %d)", s.Owner, *s.OwnerPID)
		}
		row(tw, s.Shard, s.Backlog, s.HeldBack, age(seconds(s.OldestPendingSeconds)), s.Stored, owner)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "Dead letters waiting: %d", o.DeadLetters)
	if o.DeadLetters > 0 {
		fmt.Fprint(w, " (eventline held list -kind relay_dead_letter)")
	}
	fmt.Fprintf(w, "\nRetrying: %d\n", o.Retrying)
	if o.Backlog > 0 && o.OwnedShards == 0 {
		fmt.Fprintln(w, "No relay owns a shard: start one with `eventline relay`.")
	}

	fmt.Fprintln(w)
	if len(rep.Groups) == 0 {
		fmt.Fprintln(w, "Consumer groups: none recorded yet")
	} else {
		fmt.Fprintln(w, "Consumer groups:")
		tw = newTable(w)
		row(tw, "GROUP", "DEDUP ROWS", "PARKED", "OLDEST PARKED", "SKIPPED GAPS", "SKIPPED VERSIONS")
		for _, gr := range rep.Groups {
			oldest := "-"
			if gr.Parked > 0 {
				oldest = age(seconds(gr.OldestParkedSeconds))
			}
			row(tw, gr.Group, gr.Processed, gr.Parked, oldest, gr.SkippedGaps, gr.SkippedVersions)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		if slices.ContainsFunc(rep.Groups, func(g groupReport) bool { return g.Parked > 0 }) {
			fmt.Fprintln(w, "Parked events wait for a missing version: eventline parked list")
		}
	}
	printGapsAndStalls(w, rep)
	for _, warning := range rep.Warnings {
		fmt.Fprintln(w, "warning:", warning)
	}
	return nil
}

// statusOpenGaps is how many open gaps per group status lists.
const statusOpenGaps = 10

// queryStarted formats a horizon holder's query start for a sentence.
func queryStarted(qs *string) string {
	if qs == nil {
		return ""
	}
	return ", query started " + *qs
}

// printGapsAndStalls writes the "Gaps and stalls" section: per group its
// open gaps, recent skips, late events and dead letters; per shard the
// transaction holding its events back. Nothing when all is well.
func printGapsAndStalls(w io.Writer, rep statusReport) {
	var lines []string
	for _, gr := range rep.Groups {
		if gr.OpenGaps == 0 && gr.SkippedGaps24h == 0 && gr.LateEvents == 0 && gr.DeadLetters == 0 {
			continue
		}
		line := fmt.Sprintf("  %s: %s", gr.Group, plural(gr.OpenGaps, "open gap"))
		if gr.OpenGaps > 0 {
			line += fmt.Sprintf(" (oldest %s)", age(seconds(gr.OldestOpenGapSeconds)))
		}
		line += fmt.Sprintf(", %s skipped in the last 24h, %s held, %s not resolved",
			plural(gr.SkippedGaps24h, "gap"), plural(gr.LateEvents, "late event"), plural(gr.DeadLetters, "dead letter"))
		lines = append(lines, line)
		for _, g := range gr.OpenGapList {
			lines = append(lines, fmt.Sprintf("    %s at version %d, waiting for %s for %s (%s)",
				aggregate(g.AggregateType, g.AggregateID), g.Current, versionRange(g.MissingFrom, g.MissingTo), age(seconds(g.AgeSeconds)), plural(g.Parked, "parked event")))
		}
		if n := gr.OpenGaps - int64(len(gr.OpenGapList)); n > 0 {
			lines = append(lines, fmt.Sprintf("    ... and %d more (eventline parked list -group %s)", n, gr.Group))
		}
	}
	if h := rep.Outbox.HorizonHolder; h != nil {
		for _, s := range rep.Outbox.Shards {
			if s.HeldBack == 0 {
				continue
			}
			lines = append(lines, fmt.Sprintf("  shard %d: %s held back by pid %d (%s, open %s%s, application %q)",
				s.Shard, plural(s.HeldBack, "committed event"), h.PID, h.State, age(seconds(h.XactAgeSeconds)), queryStarted(h.QueryStart), h.ApplicationName))
		}
	}
	if len(lines) == 0 {
		return
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Gaps and stalls:")
	for _, l := range lines {
		fmt.Fprintln(w, l)
	}
	if slices.ContainsFunc(rep.Groups, func(g groupReport) bool { return g.OpenGaps > 0 }) {
		fmt.Fprintln(w, "  Where the missing versions are: eventline parked list")
	}
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
