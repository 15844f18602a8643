package eventline_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// compiledMarker precedes a README snippet that is a copy of code in a Go
// file of the repository, which the build compiles and the tests run.
var compiledMarker = regexp.MustCompile(`^<!-- compiled: (\S+) -->$`)

// TestReadmeSnippetsAreCompiledCode checks every Go snippet in README.md
// marked `<!-- compiled: path -->`: its lines must appear, in order and
// together, in that file (indentation, blank lines and runs of spaces
// aside), so a snippet that no longer compiles fails here rather than in a
// reader's editor.
func TestReadmeSnippetsAreCompiledCode(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	lines := strings.Split(string(readme), "\n")
	checked := 0
	for i := 0; i < len(lines); i++ {
		m := compiledMarker.FindStringSubmatch(strings.TrimSpace(lines[i]))
		if m == nil {
			continue
		}
		require.Less(t, i+1, len(lines), "README.md:%d: marker without a snippet", i+1)
		require.Equal(t, "```go", strings.TrimSpace(lines[i+1]), "README.md:%d: a compiled marker must be followed by a ```go block", i+1)
		end := i + 2
		for end < len(lines) && strings.TrimSpace(lines[end]) != "```" {
			end++
		}
		require.Less(t, end, len(lines), "README.md:%d: unterminated snippet", i+2)
		src, err := os.ReadFile(m[1])
		require.NoError(t, err, "README.md:%d names %s", i+1, m[1])
		snippet, file := normalize(lines[i+2:end]), normalize(strings.Split(string(src), "\n"))
		require.NotEmpty(t, snippet, "README.md:%d: empty snippet", i+2)
		require.True(t, containsRun(file, snippet), "README.md:%d: the snippet is not in %s any more; copy it from there again:\n%s",
			i+2, m[1], strings.Join(snippet, "\n"))
		checked++
		i = end
	}
	require.Positive(t, checked, "README.md has no compiled snippet")
}

var spaces = regexp.MustCompile(`\s+`)

func normalize(lines []string) []string {
	var out []string
	for _, l := range lines {
		if l = spaces.ReplaceAllString(strings.TrimSpace(l), " "); l != "" {
			out = append(out, l)
		}
	}
	return out
}

// containsRun reports whether want appears in have as consecutive lines.
func containsRun(have, want []string) bool {
	for i := 0; i+len(want) <= len(have); i++ {
		match := true
		for j, w := range want {
			if have[i+j] != w {
				match = false
				break
			}
		}
		if match {
			return true
		}
	}
	return false
}
