package eventline_test

import (
	"os"
	"regexp"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// README.md's table of make targets lists exactly the Makefile's
// documented targets (those with a "## " help text), so neither drifts.
func TestReadmeListsTheMakeTargets(t *testing.T) {
	makefile, err := os.ReadFile("Makefile")
	require.NoError(t, err)
	var targets []string
	for _, m := range regexp.MustCompile(`(?m)^([a-zA-Z_-]+):.*## `).FindAllStringSubmatch(string(makefile), -1) {
		if m[1] != "help" {
			targets = append(targets, m[1])
		}
	}
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	section := regexp.MustCompile("(?s)`make help` lists the targets:\n\n(.*?)\n\n").FindSubmatch(readme)
	require.NotNil(t, section, "README.md: the table after \"`make help` lists the targets:\"")
	var listed []string
	for _, m := range regexp.MustCompile("`make ([a-z-]+)`").FindAllSubmatch(section[1], -1) {
		listed = append(listed, string(m[1]))
	}
	slices.Sort(targets)
	slices.Sort(listed)
	require.Equal(t, targets, listed, "README.md's make targets and the Makefile's")
}
