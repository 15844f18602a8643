package bench

import (
	"fmt"
	"io"
	"math"
	"strings"
	"text/tabwriter"
)

// Write prints the table, the notes and the ratio lines.
func (r Report) Write(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SCENARIO\tMETRIC\tEVENTLINE\tBASELINE\tRATIO\tTARGET\tBASELINE IS")
	for _, res := range r.Results {
		for _, row := range res.Rows {
			target := row.Target
			if target == "" {
				target = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.2f\t%s\t%s\n", res.Scenario, row.Metric,
				formatFigure(row.Ours), formatFigure(row.Base), row.Ratio(), target, row.Baseline)
		}
	}
	_ = tw.Flush()
	fmt.Fprintln(w)
	for _, res := range r.Results {
		for _, n := range res.Notes {
			fmt.Fprintf(w, "note %s: %s\n", res.Scenario, n)
		}
	}
	fmt.Fprintln(w)
	for _, res := range r.Results {
		for _, q := range res.Ratios {
			fmt.Fprintf(w, "ratio %s=%.2f\n", q.Name, q.Value)
		}
	}
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
	return fmt.Sprintf("producers=%d phase=%s×%d relay_backlog=%d consumer_backlog=%d×%d slow_backlog=%d rates=%s/%s idle=%s",
		s.Producers, s.ProducerPhase, s.Rounds, s.RelayBacklog, s.ConsumerBacklog, s.ConsumerRounds, s.SlowBacklog,
		strings.Join(rates, ","), s.RatePhase, s.IdleWindow)
}
