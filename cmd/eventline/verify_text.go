package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/eventline/eventline/admin/verify"
)

// writeVerifyText writes verify's report for people: a summary of the
// outbox, Kafka and each group, then the findings (most serious first),
// the notes, and a last line starting with "OK" or "FAILED".
func writeVerifyText(w io.Writer, r *verify.Report) error {
	var b strings.Builder // written to w at once, so one error says it all
	window := "all retained data"
	switch {
	case r.Since != nil && r.Until != nil:
		window = "from " + timestamp(*r.Since) + " to " + timestamp(*r.Until)
	case r.Since != nil:
		window = "since " + timestamp(*r.Since)
	case r.Until != nil:
		window = "until " + timestamp(*r.Until)
	}
	schema := "schema " + r.Schema
	if r.ConsumerSchema != r.Schema || r.SeparateConsumerDatabase {
		schema += ", consumer schema " + r.ConsumerSchema
		if r.SeparateConsumerDatabase {
			schema += " in its own database"
		}
	}
	fmt.Fprintf(&b, "eventline verify: %s, %s, checked %s\n", schema, window, timestamp(r.CheckedAt))
	o := r.Outbox
	fmt.Fprintf(&b, "Outbox: %s, %s, %d relayed, %d pending", plural(int64(o.Shards), "shard"), plural(o.Events, "event"), o.Relayed, o.Pending)
	if o.Pending > 0 {
		fmt.Fprintf(&b, " (oldest %s)", age(seconds(o.OldestPendingSeconds)))
	}
	fmt.Fprintf(&b, ", %d retrying, %s not replayed\n", o.Retrying, plural(o.DeadLetters, "dead letter"))
	if !r.Kafka.Checked {
		fmt.Fprintf(&b, "Kafka: not read\n")
	} else {
		var parts []string
		for _, t := range r.Kafka.Topics {
			switch {
			case t.Missing:
				parts = append(parts, t.Topic+" (missing)")
			default:
				s := fmt.Sprintf("%s (%s, %s, %s)", t.Topic, plural(int64(t.Partitions), "partition"), plural(t.Records, "record"), plural(t.Duplicates, "duplicate"))
				parts = append(parts, s)
			}
		}
		if len(parts) == 0 {
			parts = []string{"no topic to read"}
		}
		fmt.Fprintf(&b, "Kafka: read to the high watermark: %s\n", strings.Join(parts, "; "))
	}
	fmt.Fprintf(&b, "\n")
	if len(r.Groups) == 0 {
		fmt.Fprintf(&b, "Consumer groups: none found\n")
	} else {
		tw := newTable(&b)
		fmt.Fprintln(tw, "GROUP\tTOPICS\tEVENTS\tAPPLIED\tPENDING\tSTUCK\tLOST\tDISCARDED\tTWICE\tOUT OF ORDER\tPARKED\tSKIPPED\tDEAD LETTERS\tLATE")
		for _, g := range r.Groups {
			twice := "-"
			if g.AppliedTwice != nil {
				twice = fmt.Sprint(*g.AppliedTwice)
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%d\t%d\t%d\t%d\t%d\n", g.Group, orDash(strings.Join(g.Topics, ",")), g.Events, g.Outcomes["applied"],
				g.Pending, g.Stuck, g.Lost, g.Discarded, twice, g.OutOfOrder, g.Parked, g.SkippedGaps, g.ConsumerDeadLetters, g.LateHeld)
		}
		_ = tw.Flush() // into b: cannot fail
	}
	if len(r.Findings) > 0 {
		fmt.Fprintf(&b, "\nFindings:\n")
		for _, f := range r.Findings {
			fmt.Fprintf(&b, "  %-7s  %s\n", strings.ToUpper(string(f.Severity)), findingHeadline(f))
			fmt.Fprintf(&b, "           %s\n", f.Detail)
		}
	}
	for _, o := range r.Omitted {
		who := "the relay"
		if o.Group != "" {
			who = "group " + o.Group
		}
		fmt.Fprintf(&b, "  … and %d more %s %s findings of %s (raise -max-details to list them)\n", o.Count, o.Severity, o.Kind, who)
	}
	if len(r.Notes) > 0 {
		fmt.Fprintf(&b, "\nNotes:\n")
		for _, n := range r.Notes {
			fmt.Fprintf(&b, "  - %s\n", n)
		}
	}
	fmt.Fprintf(&b, "\n")
	switch {
	case !r.OK:
		fmt.Fprintf(&b, "FAILED: %s, %s.\n", plural(r.Problems, "problem"), plural(r.Warnings, "warning"))
	case r.Warnings > 0:
		fmt.Fprintf(&b, "OK: no problems, %s.\n", plural(r.Warnings, "warning"))
	default:
		fmt.Fprintf(&b, "OK: no problems found.\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// findingHeadline is a finding's first line: kind, group, aggregate,
// event, age.
func findingHeadline(f verify.Finding) string {
	parts := []string{string(f.Kind)}
	if f.Group != "" {
		parts = append(parts, "group "+f.Group)
	} else if f.Kind == verify.DeadLetter {
		parts = append(parts, "relay")
	}
	if f.AggregateType != "" || f.AggregateID != "" {
		a := f.AggregateType + "/" + f.AggregateID
		switch {
		case f.ToVersion > 0 && f.ToVersion != f.AggregateVersion:
			a += fmt.Sprintf(" v%d..v%d", f.AggregateVersion, f.ToVersion)
		case f.AggregateVersion > 0:
			a += fmt.Sprintf(" v%d", f.AggregateVersion)
		}
		parts = append(parts, a)
	}
	if f.EventID != "" {
		parts = append(parts, "event "+f.EventID)
	}
	if f.Topic != "" {
		parts = append(parts, "topic "+f.Topic)
	}
	if f.At != nil {
		parts = append(parts, age(seconds(f.AgeSeconds))+" ago")
	}
	return strings.Join(parts, "  ")
}
