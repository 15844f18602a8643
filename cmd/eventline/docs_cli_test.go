package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// cliDocs are the pages whose `eventline …` commands and flags must exist,
// relative to the repository's root (this module's directory is
// cmd/eventline).
var cliDocs = []string{"README.md", "docs/OPERATIONS.md", "docs/DESIGN.md", "examples/README.md"}

// repoRoot is the repository's root, from this module's directory.
const repoRoot = "../.."

// TestDocumentedCommandsAndFlagsExist builds the eventline command and checks
// the docs against it: every `eventline <command> [<subcommand>] -flag` in a
// code span or a shell block names a command, subcommand and flags that the
// command's -h lists; the README's list of commands is the CLI's; and
// docs/OPERATIONS.md has a row for every command. A subtest first makes
// sure the check can fail: an unknown command, subcommand or flag is
// reported, and what is right is not.
func TestDocumentedCommandsAndFlagsExist(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the eventline command")
	}
	cli := buildCLI(t)
	commands := cli.commands(t)
	require.NotEmpty(t, commands)

	t.Run("the check fails on wrong invocations", func(t *testing.T) {
		for _, span := range []string{
			"eventline relay -no-such-flag",
			"eventline no-such-command",
			"eventline held no-such-subcommand",
			"eventline migrate up\\|sideways",
			"go run ./cmd/eventline kafka-dev -topic orders",
			"eventline relay rebase-positions -force",
			"go run -C cmd/eventline . kafka-dev -topic orders",
		} {
			problems, _ := cli.checkInvocation(t, commands, span)
			require.NotEmpty(t, problems, "%q was accepted", span)
		}
		for _, span := range []string{
			"eventline migrate up\\|down\\|status",
			"eventline -schema s relay -metrics-addr :9090",
			"go run github.com/eventline/eventline/cmd/eventline kafka-dev -topics orders",
			"eventline relay rebase-positions [-dry-run]",
			"eventline consumer: cannot reach the Kafka brokers", // an error message, not an invocation
			"go run -C cmd/eventline . kafka-dev -topics orders",
		} {
			problems, _ := cli.checkInvocation(t, commands, span)
			require.Empty(t, problems, "%q was refused", span)
		}
	})

	var problems []string
	checked := 0
	for _, doc := range cliDocs {
		text, err := os.ReadFile(filepath.Join(repoRoot, doc))
		require.NoError(t, err)
		for _, span := range codeSpans(string(text)) {
			p, n := cli.checkInvocation(t, commands, span)
			problems = append(problems, prefix(doc, p)...)
			checked += n
		}
	}
	require.Empty(t, problems, "commands or flags in the docs that the eventline command does not have:\n%s", strings.Join(problems, "\n"))
	t.Logf("%d documented eventline invocations checked", checked)
	require.Greater(t, checked, 30, "the check found too few documented invocations; is the parsing broken?")

	readme, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	require.NoError(t, err)
	m := regexp.MustCompile("(?s)`eventline help` lists its commands:(.*?)\\.\n").FindStringSubmatch(string(readme))
	require.NotNil(t, m, "README.md: the sentence listing the commands after \"`eventline help` lists its commands:\"")
	var listed []string
	for _, w := range regexp.MustCompile("`([a-z-]+)`").FindAllStringSubmatch(m[1], -1) {
		listed = append(listed, w[1])
	}
	slices.Sort(listed)
	require.Equal(t, commands, listed, "README.md lists the commands of `eventline help`")

	ops, err := os.ReadFile(filepath.Join(repoRoot, "docs", "OPERATIONS.md"))
	require.NoError(t, err)
	for _, c := range commands {
		require.Regexp(t, regexp.MustCompile("(?m)^\\| `eventline "+regexp.QuoteMeta(c)+"[ `\\\\]"), string(ops),
			"docs/OPERATIONS.md has a row in the command table for `eventline %s`", c)
	}
}

type cliBinary struct {
	path string
	help map[string]string // command path ("dlq replay") -> its -h output
}

func buildCLI(t *testing.T) *cliBinary {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "eventline")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build (in cmd/eventline): %s", out)
	return &cliBinary{path: bin, help: map[string]string{}}
}

// helpOf returns the -h output of a command path, or "" if the CLI does
// not know it.
func (c *cliBinary) helpOf(t *testing.T, path ...string) string {
	t.Helper()
	key := strings.Join(path, " ")
	if h, ok := c.help[key]; ok {
		return h
	}
	out, _ := exec.Command(c.path, append(slices.Clone(path), "-h")...).CombinedOutput()
	h := string(out)
	if strings.Contains(h, "unknown command") || strings.Contains(h, "unknown subcommand") {
		h = ""
	}
	c.help[key] = h
	return h
}

// commands returns the command names `eventline help` lists, sorted.
func (c *cliBinary) commands(t *testing.T) []string {
	t.Helper()
	out, _ := exec.Command(c.path, "help").CombinedOutput()
	_, list, ok := strings.Cut(string(out), "Commands:\n")
	require.True(t, ok, "eventline help: no Commands: section in\n%s", out)
	var names []string
	for _, line := range strings.Split(list, "\n") {
		if strings.TrimSpace(line) == "" {
			break
		}
		names = append(names, strings.Fields(line)[0])
	}
	slices.Sort(names)
	return names
}

var (
	helpFlag    = regexp.MustCompile(`(?m)^\s+-([a-z][a-z0-9-]*)\b`)
	subcommands = regexp.MustCompile(`^Usage: eventline \S+ (?:<([a-z|-]+)>|\[flags\] \| ([a-z| -]+))`)
	commandWord = regexp.MustCompile(`^[a-z][a-z-]*$`)
	flagToken   = regexp.MustCompile(`^\[?(-[a-z][a-z0-9-]*)`)
)

// subcommandsOf returns the subcommands a command's usage line names.
func (c *cliBinary) subcommandsOf(t *testing.T, command string) []string {
	m := subcommands.FindStringSubmatch(c.helpOf(t, command))
	if m == nil {
		return nil
	}
	var subs []string
	for _, s := range strings.Split(m[1]+m[2], "|") {
		if s = strings.TrimSpace(s); s != "" {
			subs = append(subs, s)
		}
	}
	return subs
}

// checkInvocation checks one code span or shell line: if it runs eventline,
// its command, subcommand and flags must exist. It returns the problems and
// how many invocations it checked (0 or 1).
func (c *cliBinary) checkInvocation(t *testing.T, commands []string, span string) ([]string, int) {
	tokens := strings.Fields(span)
	start := -1
	for i, tok := range tokens {
		if tok == "eventline" || strings.HasSuffix(tok, "/cmd/eventline") {
			start = i + 1
			break
		}
		// `go run -C cmd/eventline . …`: the command's own module, run
		// from the repository's root.
		if tok == "-C" && i+2 < len(tokens) && strings.HasSuffix(tokens[i+1], "cmd/eventline") && tokens[i+2] == "." {
			start = i + 3
			break
		}
		// Only a command line runs it: `go run …`, `$ …`, `VAR=x …`; in
		// any other span ("eventline creates no topics") it is prose.
		if tok != "go" && tok != "run" && tok != "$" && !strings.Contains(tok, "=") {
			break
		}
	}
	if start < 0 {
		return nil, 0
	}
	rest := tokens[start:]
	// Global flags may come first: -schema s, -log-level debug.
	for len(rest) >= 2 && strings.HasPrefix(rest[0], "-") {
		rest = rest[2:]
	}
	if len(rest) == 0 || !commandWord.MatchString(rest[0]) {
		return nil, 0 // prose: "eventline" alone, or an error message ("eventline consumer: …")
	}
	command := rest[0]
	if !slices.Contains(commands, command) {
		if command == "help" {
			return nil, 1
		}
		return []string{"unknown command in `" + span + "`: " + command}, 1
	}
	rest = rest[1:]
	paths := [][]string{{command}}
	if subs := c.subcommandsOf(t, command); len(subs) > 0 && len(rest) > 0 && !strings.HasPrefix(rest[0], "-") && !strings.HasPrefix(rest[0], "<") {
		var named []string
		for _, s := range regexp.MustCompile(`\\?\||/`).Split(rest[0], -1) {
			named = append(named, strings.Trim(s, "[]"))
		}
		paths = nil
		for _, s := range named {
			if !slices.Contains(subs, s) {
				return []string{"unknown subcommand in `" + span + "`: " + command + " " + s}, 1
			}
			paths = append(paths, []string{command, s})
		}
		rest = rest[1:]
	}
	var problems []string
	for _, tok := range rest {
		m := flagToken.FindStringSubmatch(tok)
		if m == nil {
			continue
		}
		flag := m[1][1:]
		found := false
		for _, p := range paths {
			for _, h := range helpFlag.FindAllStringSubmatch(c.helpOf(t, p...), -1) {
				found = found || h[1] == flag
			}
		}
		if !found {
			problems = append(problems, "unknown flag in `"+span+"`: -"+flag)
		}
	}
	return problems, 1
}

// codeSpans returns a document's inline code spans (which may wrap across
// lines) and the lines of its shell blocks.
func codeSpans(text string) []string {
	var spans []string
	var prose strings.Builder
	inShell, inOther := false, false
	for _, line := range strings.Split(text, "\n") {
		trimmed := strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(trimmed, "```") && (inShell || inOther):
			inShell, inOther = false, false
			continue
		case trimmed == "```sh" || trimmed == "```bash" || trimmed == "```shell":
			inShell = true
			continue
		case strings.HasPrefix(trimmed, "```"):
			inOther = true
			continue
		}
		switch {
		case inShell:
			if cmd, _, _ := strings.Cut(line, "#"); strings.TrimSpace(cmd) != "" {
				spans = append(spans, cmd)
			}
		case !inOther:
			prose.WriteString(line)
			prose.WriteString("\n")
		}
	}
	parts := strings.Split(prose.String(), "`")
	for i := 1; i < len(parts)-1; i += 2 {
		spans = append(spans, strings.ReplaceAll(parts[i], "\n", " "))
	}
	return spans
}

func prefix(doc string, lines []string) []string {
	out := make([]string, len(lines))
	for i, l := range lines {
		out[i] = doc + ": " + l
	}
	return out
}
