package verify

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// WriteText writes the report for people: a summary of the outbox, Kafka
// and each group, then the findings (most serious first), the notes, and a
// last line starting with "OK" or "FAILED".
func (r *Report) WriteText(w io.Writer) error {
	ew := &errWriter{w: w}
	window := "all retained data"
	switch {
	case r.Since != nil && r.Until != nil:
		window = "from " + stamp(*r.Since) + " to " + stamp(*r.Until)
	case r.Since != nil:
		window = "since " + stamp(*r.Since)
	case r.Until != nil:
		window = "until " + stamp(*r.Until)
	}
	schema := "schema " + r.Schema
	if r.ConsumerSchema != r.Schema || r.SeparateConsumerDatabase {
		schema += ", consumer schema " + r.ConsumerSchema
		if r.SeparateConsumerDatabase {
			schema += " in its own database"
		}
	}
	ew.printf("eventline verify: %s, %s, checked %s\n", schema, window, stamp(r.CheckedAt))
	o := r.Outbox
	ew.printf("Outbox: %s, %s, %d relayed, %d pending", count(int64(o.Shards), "shard"), count(o.Events, "event"), o.Relayed, o.Pending)
	if o.Pending > 0 {
		ew.printf(" (oldest %s)", ageOf(o.OldestPendingSeconds))
	}
	ew.printf(", %d retrying, %s not replayed\n", o.Retrying, count(o.DeadLetters, "dead letter"))
	if !r.Kafka.Checked {
		ew.printf("Kafka: not read\n")
	} else {
		var parts []string
		for _, t := range r.Kafka.Topics {
			switch {
			case t.Missing:
				parts = append(parts, t.Topic+" (missing)")
			default:
				s := fmt.Sprintf("%s (%s, %s, %s)", t.Topic, count(int64(t.Partitions), "partition"), count(t.Records, "record"), count(t.Duplicates, "duplicate"))
				parts = append(parts, s)
			}
		}
		if len(parts) == 0 {
			parts = []string{"no topic to read"}
		}
		ew.printf("Kafka: read to the high watermark: %s\n", strings.Join(parts, "; "))
	}
	ew.printf("\n")
	if len(r.Groups) == 0 {
		ew.printf("Consumer groups: none found\n")
	} else {
		tw := tabwriter.NewWriter(ew, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "GROUP\tTOPICS\tEVENTS\tAPPLIED\tPENDING\tSTUCK\tLOST\tDISCARDED\tTWICE\tOUT OF ORDER\tPARKED\tSKIPPED\tDEAD LETTERS\tLATE")
		for _, g := range r.Groups {
			topics := strings.Join(g.Topics, ",")
			if topics == "" {
				topics = "-"
			}
			twice := "-"
			if g.AppliedTwice != nil {
				twice = fmt.Sprint(*g.AppliedTwice)
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%d\t%d\t%d\t%d\t%d\n", g.Group, topics, g.Events, g.Outcomes["applied"],
				g.Pending, g.Stuck, g.Lost, g.Discarded, twice, g.OutOfOrder, g.Parked, g.SkippedGaps, g.ConsumerDeadLetters, g.LateHeld)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if len(r.Findings) > 0 {
		ew.printf("\nFindings:\n")
		for _, f := range r.Findings {
			ew.printf("  %-7s  %s\n", strings.ToUpper(string(f.Severity)), f.headline())
			ew.printf("           %s\n", f.Detail)
		}
	}
	for _, o := range r.Omitted {
		who := "the relay"
		if o.Group != "" {
			who = "group " + o.Group
		}
		ew.printf("  … and %d more %s %s findings of %s (raise -max-details to list them)\n", o.Count, o.Severity, o.Kind, who)
	}
	if len(r.Notes) > 0 {
		ew.printf("\nNotes:\n")
		for _, n := range r.Notes {
			ew.printf("  - %s\n", n)
		}
	}
	ew.printf("\n")
	switch {
	case !r.OK:
		ew.printf("FAILED: %s, %s.\n", count(r.Problems, "problem"), count(r.Warnings, "warning"))
	case r.Warnings > 0:
		ew.printf("OK: no problems, %s.\n", count(r.Warnings, "warning"))
	default:
		ew.printf("OK: no problems found.\n")
	}
	return ew.err
}

// headline is a finding's first line: kind, group, aggregate, event, age.
func (f Finding) headline() string {
	parts := []string{string(f.Kind)}
	if f.Group != "" {
		parts = append(parts, "group "+f.Group)
	} else if f.Kind == DeadLetter {
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
		parts = append(parts, ageOf(f.AgeSeconds)+" ago")
	}
	return strings.Join(parts, "  ")
}

type errWriter struct {
	w   io.Writer
	err error
}

func (e *errWriter) Write(p []byte) (int, error) {
	if e.err != nil {
		return 0, e.err
	}
	n, err := e.w.Write(p)
	e.err = err
	return n, err
}

func (e *errWriter) printf(format string, args ...any) { fmt.Fprintf(e, format, args...) }

func stamp(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05Z") }

// ageOf formats seconds for people: 42s, 3m12s, 5h4m, 2d3h.
func ageOf(seconds float64) string {
	d := time.Duration(max(seconds, 0) * float64(time.Second)).Round(time.Second)
	switch {
	case d < time.Hour:
		s := d.String()
		if strings.HasSuffix(s, "m0s") {
			s = strings.TrimSuffix(s, "0s")
		}
		return s
	case d < 24*time.Hour:
		return strings.TrimSuffix(d.Truncate(time.Minute).String(), "0s")
	default:
		return fmt.Sprintf("%dd%dh", int64(d/(24*time.Hour)), int64(d%(24*time.Hour)/time.Hour))
	}
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

// count returns "1 event" or "3 events".
func count(n int64, word string) string {
	if n == 1 {
		return fmt.Sprintf("%d %s", n, word)
	}
	return fmt.Sprintf("%d %ss", n, word)
}
