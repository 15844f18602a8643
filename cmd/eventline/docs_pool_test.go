package main

import (
	"os"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDocsStateTheRelaysMetricsConnections checks that the README and
// docs/OPERATIONS.md give the number of connections `eventline relay` adds
// to its pool for metrics scrapes as the code does: OPERATIONS.md said
// one while the relay adds two.
func TestDocsStateTheRelaysMetricsConnections(t *testing.T) {
	words := map[string]int{"one": 1, "two": 2, "three": 3, "four": 4}
	stated := regexp.MustCompile("`eventline relay`[^)]*?\\b(one|two|three|four)\\s+(?:more\\s+connections\\s+)?for\\s+metrics")
	for _, doc := range []string{"../../README.md", "../../docs/OPERATIONS.md"} {
		text, err := os.ReadFile(doc)
		require.NoError(t, err)
		m := stated.FindAllStringSubmatch(string(text), -1)
		require.NotEmpty(t, m, "%s: no sentence saying how many connections `eventline relay` adds for metrics", doc)
		for _, s := range m {
			require.Equal(t, metricsScrapeConns, words[s[1]], "%s: %q", doc, s[0])
		}
	}
}
