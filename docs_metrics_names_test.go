package eventline_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// notMetrics are eventline_* names the docs use for something else.
var notMetrics = map[string]string{
	"eventline_outbox": "the NOTIFY channel of the outbox triggers",
}

// TestDocumentedMetricNamesExist checks that every eventline_* metric the
// README and the docs name is a row of docs/METRICS.md, which
// internal/metricsdoc keeps equal to what the collectors expose; a name
// followed by * must be the prefix of one. So an alert in
// docs/OPERATIONS.md cannot name a metric that does not exist.
func TestDocumentedMetricNamesExist(t *testing.T) {
	metricsDoc, err := os.ReadFile("docs/METRICS.md")
	require.NoError(t, err)
	documented := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `(eventline_[a-z0-9_]+)` \\|").FindAllStringSubmatch(string(metricsDoc), -1) {
		documented[m[1]] = true
	}
	require.Greater(t, len(documented), 20, "docs/METRICS.md: no metric rows found")

	name := regexp.MustCompile(`\beventline_[a-z0-9_]+\*?`)
	var problems []string
	for _, doc := range []string{"README.md", "docs/OPERATIONS.md", "docs/DESIGN.md", "docs/BENCHMARKS.md", "examples/README.md"} {
		text, err := os.ReadFile(doc)
		require.NoError(t, err)
		for _, n := range name.FindAllString(string(text), -1) {
			if prefix, wild := strings.CutSuffix(n, "*"); wild {
				if !anyHasPrefix(documented, prefix) {
					problems = append(problems, doc+": "+n+" matches no metric")
				}
				continue
			}
			base := regexp.MustCompile(`_(bucket|sum|count)$`).ReplaceAllString(n, "")
			if documented[n] || documented[base] || notMetrics[n] != "" {
				continue
			}
			problems = append(problems, doc+": "+n)
		}
	}
	require.Empty(t, problems, "metric names in the docs that docs/METRICS.md (and so the code) does not have:\n%s", strings.Join(problems, "\n"))
}

func anyHasPrefix(names map[string]bool, prefix string) bool {
	for n := range names {
		if strings.HasPrefix(n, prefix) {
			return true
		}
	}
	return false
}
