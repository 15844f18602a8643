package bench

import (
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"
)

// Write prints the table, the notes and the ratio lines.
func (r Report) Write(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SCENARIO\tMETRIC\tEVENTLINE\tBASELINE\tRATIO\tTARGET\tBASELINE IS")
	for _, res := range r.Results {
		for _, row := range res.Rows {
			target := row.targetVerdict()
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.2f\t%s\t%s\n", res.Scenario, row.Metric,
				formatFigure(row.Ours), formatFigure(row.Base), row.Ratio(), target, row.Baseline)
		}
	}
	_ = tw.Flush()
	fmt.Fprintln(w)
	if r.writeCosts(w) {
		fmt.Fprintln(w)
	}
	for _, res := range r.Results {
		for _, n := range res.Notes {
			fmt.Fprintf(w, "note %s: %s\n", res.Scenario, n)
		}
	}
	if r.CostSource != "" && r.hasCosts() {
		fmt.Fprintf(w, "note cost: RT/EV and STMTS/EV are counted by a pgx tracer on each stage's own pool (see queryCounter): round trips are Query/Exec (BEGIN and COMMIT included), Batch, CopyFrom, server-side Prepare and liveness pings; %s; \"-\" where the stage shares its schema and its window with other stages\n", r.CostSource)
	}
	fmt.Fprintln(w)
	for _, res := range r.Results {
		for _, q := range res.Ratios {
			fmt.Fprintf(w, "ratio %s=%.2f\n", q.Name, q.Value)
		}
	}
}

func (r Report) hasCosts() bool {
	for _, res := range r.Results {
		if len(res.Costs) > 0 {
			return true
		}
	}
	return false
}

// writeCosts prints the cost table, if any scenario measured costs.
func (r Report) writeCosts(w io.Writer) bool {
	if !r.hasCosts() {
		return false
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STAGE\tSCENARIO\tVARIANT\tRATE/S\tEVENTS\tRT/EV\tSTMTS/EV\tROWS/EV\tWAL B/EV\tGO µs/EV\tPG µs/EV")
	for _, res := range r.Results {
		for _, c := range res.Costs {
			rate, rows, wal, goCPU, pgCPU := "-", "-", "-", "-", "-"
			if c.Rate > 0 {
				rate = formatFigure(c.Rate)
			}
			if c.Server {
				rows, wal = fmt.Sprintf("%.2f", perEvent(c.Rows, c.Events)), formatFigure(perEvent(c.WALBytes, c.Events))
			}
			if c.GoCPUOK {
				goCPU = perEventMicros(c.GoCPU, c.Events)
			}
			if c.PGCPUOK {
				pgCPU = perEventMicros(c.PGCPU, c.Events)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%.2f\t%.2f\t%s\t%s\t%s\t%s\n", c.Stage, res.Scenario, c.Variant, rate, c.Events,
				c.RoundTripsPerEvent(), c.StatementsPerEvent(), rows, wal, goCPU, pgCPU)
		}
	}
	_ = tw.Flush()
	return true
}

// Ratio returns the ratio line called name, if any scenario printed one.
func (r Report) Ratio(name string) (float64, bool) {
	for _, res := range r.Results {
		for _, q := range res.Ratios {
			if q.Name == name {
				return q.Value, true
			}
		}
	}
	return 0, false
}

func formatFigure(v float64) string {
	switch a := math.Abs(v); {
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

func describeSizes(s Sizes) string {
	rates := make([]string, len(s.Rates))
	for i, r := range s.Rates {
		rates[i] = fmt.Sprint(r)
	}
	return fmt.Sprintf("producers=%d phase=%s×%d relay_backlog=%d×%d consumer_backlog=%d×%d slow_backlog=%d rates=%s/%s idle=%s",
		s.Producers, s.ProducerPhase, s.Rounds, s.RelayBacklog, max(s.RelayRounds, 1), s.ConsumerBacklog, s.ConsumerRounds, s.SlowBacklog,
		strings.Join(rates, ","), s.RatePhase, s.IdleWindow)
}

// issue10 marks the targets of issue 10 (batched consumer transactions,
// lanes, one-round-trip PublishTx, latency at 500–1000 events/s).
const issue10 = "[#10]"

// targetVerdict returns the row's targets, each followed by ": met" or
// ": unmet". A target is "≥ x" or "≤ x" on the ratio, or "ours ≤ x <unit>"
// on eventline's figure; "; " separates several. A target it cannot read
// is returned as it is.
func (r Row) targetVerdict() string {
	if r.Target == "" {
		return "-"
	}
	parts := strings.Split(r.Target, "; ")
	for i, t := range parts {
		if met, ok := r.meets(t); ok {
			if met {
				parts[i] = t + ": met"
			} else {
				parts[i] = t + ": UNMET"
			}
		}
	}
	return strings.Join(parts, "; ")
}

// meets reports whether the row meets target t, and whether t could be
// read.
func (r Row) meets(t string) (met, ok bool) {
	v := r.Ratio()
	rest := strings.TrimSpace(t)
	if s, found := strings.CutPrefix(rest, "ours "); found {
		v, rest = r.Ours, s
	}
	var atLeast bool
	switch {
	case strings.HasPrefix(rest, "≥"):
		atLeast, rest = true, strings.TrimPrefix(rest, "≥")
	case strings.HasPrefix(rest, "≤"):
		rest = strings.TrimPrefix(rest, "≤")
	default:
		return false, false
	}
	rest = strings.TrimSpace(rest)
	end := strings.IndexFunc(rest, func(c rune) bool { return (c < '0' || c > '9') && c != '.' })
	if end < 0 {
		end = len(rest)
	}
	want, err := strconv.ParseFloat(rest[:end], 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return false, false
	}
	if atLeast {
		return v >= want, true
	}
	return v <= want, true
}
