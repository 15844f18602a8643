package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// newTable returns a writer that aligns tab-separated columns; Flush it.
func newTable(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
}

// limitFlag defines the command's -limit flag, the most rows it lists;
// parse checks it is at least 1.
func (inv *invocation) limitFlag(def int, usage string) *int {
	inv.limit = inv.fs.Int("limit", def, usage)
	return inv.limit
}

// flushLimited flushes a table of n rows listed with -limit, and says when
// the limit may have cut it short.
func (inv *invocation) flushLimited(w io.Writer, tw *tabwriter.Writer, n int) error {
	if err := tw.Flush(); err != nil || n < *inv.limit {
		return err
	}
	_, err := fmt.Fprintf(w, "(first %d shown; raise -limit for more)\n", *inv.limit)
	return err
}

// row writes one tab-separated table row.
func row(w io.Writer, cols ...any) {
	for i, c := range cols {
		if i > 0 {
			fmt.Fprint(w, "\t")
		}
		fmt.Fprint(w, c)
	}
	fmt.Fprintln(w)
}

// jsonFlag defines the command's -json flag, which makes output print JSON.
func (inv *invocation) jsonFlag(usage string) {
	inv.asJSON = inv.fs.Bool("json", false, usage)
}

// output prints the command's result: v as JSON with -json, else text.
func (inv *invocation) output(v any, text func(w io.Writer) error) error {
	if inv.asJSON != nil && *inv.asJSON {
		return writeJSON(inv.stdout, v)
	}
	return text(inv.stdout)
}

// writeJSON writes v as indented JSON followed by a newline.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// shortDuration formats d without trailing zero units: 2m, not 2m0s.
func shortDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// age formats a duration for people: 0s, 42s, 3m12s, 5h4m, 2d3h.
func age(d time.Duration) string {
	switch d = max(d, 0).Round(time.Second); {
	case d < time.Hour:
		return shortDuration(d)
	case d < 24*time.Hour:
		return shortDuration(d.Truncate(time.Minute))
	default:
		days := int64(d / (24 * time.Hour))
		hours := int64((d % (24 * time.Hour)) / time.Hour)
		return fmt.Sprintf("%dd%dh", days, hours)
	}
}

// timestamp formats t in UTC to the second; "-" for the zero time.
func timestamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

// truncate shortens s to at most n runes, on one line.
func truncate(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}

// orDash returns s, or "-" when it is empty.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// payloadJSON returns a payload for JSON output: as is when it is JSON,
// else base64.
func payloadJSON(p []byte) (json.RawMessage, []byte) {
	if json.Valid(p) {
		return p, nil
	}
	return nil, p
}

// plural returns "1 event" or "3 events".
func plural(n int64, word string) string {
	if n == 1 {
		return fmt.Sprintf("%d %s", n, word)
	}
	if strings.HasSuffix(word, "ch") || strings.HasSuffix(word, "s") {
		return fmt.Sprintf("%d %ses", n, word)
	}
	return fmt.Sprintf("%d %ss", n, word)
}

// mapList returns f of each element of list, never nil: a JSON list is
// [] when empty.
func mapList[T, U any](list []T, f func(T) U) []U {
	out := make([]U, 0, len(list))
	for _, e := range list {
		out = append(out, f(e))
	}
	return out
}
