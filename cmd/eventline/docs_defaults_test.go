package main

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin/verify"
)

// TestDesignDefaultsMatchVerify checks the verify.* rows of docs/DESIGN.md's
// "Defaults at a glance" table against the checker's constants
// (admin/verify), the defaults of `eventline verify`'s flags (the
// library's TestDesignDefaultsMatchTheCode checks the other rows). A
// verify.* row this test does not know fails too: add it here.
func TestDesignDefaultsMatchVerify(t *testing.T) {
	want := map[string]string{
		"verify.DefaultMaxPendingAge": human(verify.DefaultMaxPendingAge),
		"verify.DefaultMaxParkedAge":  human(verify.DefaultMaxParkedAge),
	}
	design, err := os.ReadFile("../../docs/DESIGN.md")
	require.NoError(t, err)
	_, after, ok := strings.Cut(string(design), "\n## Defaults at a glance\n")
	require.True(t, ok, "docs/DESIGN.md has no Defaults at a glance section")
	seen := map[string]bool{}
	for _, line := range strings.Split(after, "\n") {
		if strings.HasPrefix(line, "## ") {
			break
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if !strings.HasPrefix(line, "|") || len(cells) != 3 {
			continue
		}
		constant := strings.Trim(strings.TrimSpace(cells[2]), "`")
		if !strings.HasPrefix(constant, "verify.") {
			continue
		}
		w, ok := want[constant]
		require.True(t, ok, "docs/DESIGN.md, Defaults at a glance: %s is not checked by this test; add it", constant)
		require.Equal(t, w, strings.TrimSpace(cells[1]), "docs/DESIGN.md, Defaults at a glance: %s (%s)", constant, strings.TrimSpace(cells[0]))
		seen[constant] = true
	}
	for c := range want {
		require.True(t, seen[c], "docs/DESIGN.md, Defaults at a glance: no row for %s", c)
	}
}

// human writes a duration the way the docs do (the library's
// docs_defaults_test.go has the full version): 5 min, 24 h, 7 days.
func human(d time.Duration) string {
	switch {
	case d >= 48*time.Hour && d%(24*time.Hour) == 0:
		return fmt.Sprintf("%d days", d/(24*time.Hour))
	case d%time.Hour == 0:
		return fmt.Sprintf("%d h", d/time.Hour)
	case d%time.Minute == 0:
		return fmt.Sprintf("%d min", d/time.Minute)
	default:
		return d.String()
	}
}
