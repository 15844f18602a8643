package eventline_test

import (
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// compiledMarker precedes a README snippet that is a copy of code in a Go
// file of the repository, which the build compiles and the tests run.
var compiledMarker = regexp.MustCompile(`^<!-- compiled: (\S+) -->$`)

// TestEveryReadmeGoSnippetIsCompiled checks every ```go block of README.md
// (and of the docs pages): each must be preceded by a marker line
// `<!-- compiled: path -->`, and its lines must appear, in order and
// together, in that Go file (indentation, blank lines and runs of spaces
// aside). The file is compiled by `go test` and `go vet`, so a snippet
// that no longer compiles, or a README edit that was not made in the
// compiled copy, fails here rather than in a reader's editor.
func TestEveryReadmeGoSnippetIsCompiled(t *testing.T) {
	checked := 0
	for _, doc := range []string{"README.md", "docs/OPERATIONS.md", "docs/DESIGN.md"} {
		text, err := os.ReadFile(doc)
		require.NoError(t, err)
		n, problems := checkGoSnippets(doc, string(text), os.ReadFile)
		require.Empty(t, problems, "%s: Go snippets that are not compiled code:\n%s", doc, strings.Join(problems, "\n"))
		checked += n
	}
	require.Positive(t, checked, "README.md has no compiled snippet")
}

// TestSnippetCheckFailsOnBrokenSnippets makes sure the check above can
// fail: an unmarked block, a snippet that drifted from its compiled copy,
// and a marker naming a missing file are all reported.
func TestSnippetCheckFailsOnBrokenSnippets(t *testing.T) {
	files := map[string]string{"code.go": "package x\n\nfunc f() {\n\tx := 1\n\t_ = x\n}\n"}
	read := func(name string) ([]byte, error) {
		if s, ok := files[name]; ok {
			return []byte(s), nil
		}
		return nil, fmt.Errorf("open %s: no such file", name)
	}
	for name, doc := range map[string]string{
		"unmarked":     "text\n\n```go\nx := 1\n```\n",
		"drifted":      "<!-- compiled: code.go -->\n```go\nx := 2\n_ = x\n```\n",
		"missing file": "<!-- compiled: gone.go -->\n```go\nx := 1\n```\n",
		"empty":        "<!-- compiled: code.go -->\n```go\n```\n",
		"unterminated": "<!-- compiled: code.go -->\n```go\nx := 1\n",
	} {
		_, problems := checkGoSnippets(name+".md", doc, read)
		require.NotEmpty(t, problems, "%s: the check accepted a broken snippet", name)
	}
	n, problems := checkGoSnippets("ok.md", "<!-- compiled: code.go -->\n```go\n  x := 1\n\n_ = x\n```\n\n```sh\nmake test\n```\n", read)
	require.Empty(t, problems)
	require.Equal(t, 1, n)
}

// checkGoSnippets returns how many ```go blocks of text are compiled code,
// and a line per block that is not.
func checkGoSnippets(doc, text string, read func(string) ([]byte, error)) (checked int, problems []string) {
	lines := strings.Split(text, "\n")
	for i := 0; i < len(lines); i++ {
		if strings.TrimSpace(lines[i]) != "```go" {
			continue
		}
		end := i + 1
		for end < len(lines) && strings.TrimSpace(lines[end]) != "```" {
			end++
		}
		if end == len(lines) {
			problems = append(problems, fmt.Sprintf("%s:%d: unterminated ```go block", doc, i+1))
			break
		}
		block := lines[i+1 : end]
		start := i
		i = end
		var m []string
		if start > 0 {
			m = compiledMarker.FindStringSubmatch(strings.TrimSpace(lines[start-1]))
		}
		if m == nil {
			problems = append(problems, fmt.Sprintf("%s:%d: a ```go block without a `<!-- compiled: path -->` line right above it; put the code in a Go file the tests compile and name it there", doc, start+1))
			continue
		}
		src, err := read(m[1])
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s:%d: the marker names %s: %v", doc, start, m[1], err))
			continue
		}
		snippet, file := normalize(block), normalize(strings.Split(string(src), "\n"))
		if len(snippet) == 0 {
			problems = append(problems, fmt.Sprintf("%s:%d: empty snippet", doc, start+1))
			continue
		}
		if !containsRun(file, snippet) {
			problems = append(problems, fmt.Sprintf("%s:%d: the snippet is not in %s (any more); make the same change there, or copy it from there again:\n%s",
				doc, start+1, m[1], strings.Join(snippet, "\n")))
			continue
		}
		checked++
	}
	return checked, problems
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
