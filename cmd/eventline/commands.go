package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
)

// command is one eventline subcommand. A file adds its commands from an
// init function:
//
//	func init() {
//		register(command{name: "version", summary: "Print the eventline version", run: runVersion})
//	}
//
// run gets the arguments after the command name. The usual shape is:
//
//	func runVersion(ctx context.Context, args []string) error {
//		fs := newFlagSet(ctx, "version", "[-json]", "Prints the version ...")
//		asJSON := fs.Bool("json", false, "Print JSON.")
//		if _, err := fs.parse(args); err != nil {
//			return err // -h, or a usage error
//		}
//		g := globalsOf(ctx) // -database-url, -schema, -brokers, parsed
//		fmt.Fprintln(stdout(ctx), "...")
//		return nil
//	}
//
// Output goes to stdout(ctx) (results) and stderr(ctx) or logger(ctx)
// (diagnostics), so tests can run commands in-process. Return
// usageErrorf(...) for bad arguments (exit code 2) and any other error for
// a failure (exit code 1); run prints it.
type command struct {
	// name is the word after `eventline`.
	name string
	// summary is the one-line description in `eventline -h`.
	summary string
	// run executes the command.
	run func(ctx context.Context, args []string) error
}

var (
	registryMu sync.Mutex
	registry   = map[string]command{}
)

// register adds a command. It panics on a duplicate or incomplete command:
// that is a programming error found at startup.
func register(c command) {
	registryMu.Lock()
	defer registryMu.Unlock()
	if c.name == "" || c.run == nil {
		panic("eventline: register needs a command name and a run function")
	}
	if _, dup := registry[c.name]; dup {
		panic("eventline: command " + c.name + " registered twice")
	}
	registry[c.name] = c
}

// lookup returns the command with the given name.
func lookup(name string) (command, bool) {
	registryMu.Lock()
	defer registryMu.Unlock()
	c, ok := registry[name]
	return c, ok
}

// commands returns every command, sorted by name.
func commands() []command {
	registryMu.Lock()
	defer registryMu.Unlock()
	out := make([]command, 0, len(registry))
	for _, c := range registry {
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b command) int { return strings.Compare(a.name, b.name) })
	return out
}

// commandNames returns the sorted command names.
func commandNames() []string {
	var names []string
	for _, c := range commands() {
		names = append(names, c.name)
	}
	return names
}

// errHelp is returned after help was printed on request; the exit code is 0.
var errHelp = errors.New("help requested")

// usageError is a mistake in the command line: the exit code is 2.
type usageError struct {
	path string // command path, e.g. "held replay"; empty for the top level
	msg  string
}

func (e *usageError) Error() string { return e.msg }

// usageErrorf returns a usage error for the command at path.
func usageErrorf(path, format string, args ...any) error {
	return &usageError{path: path, msg: fmt.Sprintf(format, args...)}
}

// invocation is the state of one run of the CLI: where output goes, the
// environment, and the global flags. Commands reach it through ctx.
type invocation struct {
	stdout, stderr io.Writer
	getenv         func(string) string
	globals        *globals
	// path is the command being run, for error messages.
	path string

	logOnce sync.Once
	log     *slog.Logger
}

func newInvocation(stdout, stderr io.Writer, getenv func(string) string) *invocation {
	return &invocation{stdout: stdout, stderr: stderr, getenv: getenv, globals: globalsFromEnv(getenv)}
}

// logger returns the logger configured by -log-level and -log-format,
// writing to stderr. The flags were validated when they were parsed.
func (inv *invocation) logger() *slog.Logger {
	inv.logOnce.Do(func() {
		l, err := newLogger(inv.stderr, inv.globals.logLevel, inv.globals.logFormat)
		if err != nil {
			l = slog.New(slog.NewTextHandler(inv.stderr, nil))
		}
		inv.log = l
	})
	return inv.log
}

type invocationKey struct{}

func withInvocation(ctx context.Context, inv *invocation) context.Context {
	return context.WithValue(ctx, invocationKey{}, inv)
}

// invocationOf returns the invocation in ctx, or one on the process's
// standard streams and environment when ctx has none.
func invocationOf(ctx context.Context) *invocation {
	if inv, ok := ctx.Value(invocationKey{}).(*invocation); ok {
		return inv
	}
	return newInvocation(os.Stdout, os.Stderr, os.Getenv)
}

// stdout is where a command writes its results.
func stdout(ctx context.Context) io.Writer { return invocationOf(ctx).stdout }

// stderr is where a command writes diagnostics.
func stderr(ctx context.Context) io.Writer { return invocationOf(ctx).stderr }

// logger is the command's structured logger (on stderr).
func logger(ctx context.Context) *slog.Logger { return invocationOf(ctx).logger() }

// globalsOf returns the global configuration after the flags were parsed.
func globalsOf(ctx context.Context) *globals { return invocationOf(ctx).globals }

// subcommand is one verb of a command group such as `held list`.
type subcommand struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string) error
}

// dispatch runs the subcommand of group named by args[0].
func dispatch(ctx context.Context, group, summary string, args []string, subs []subcommand) error {
	inv := invocationOf(ctx)
	inv.path = group
	var names []string
	for _, s := range subs {
		names = append(names, s.name)
	}
	if len(args) == 0 {
		return usageErrorf(group, "missing subcommand: one of %s", strings.Join(names, ", "))
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		w := inv.stdout
		fmt.Fprintf(w, "Usage: eventline %s <%s> [flags] [arguments]\n\n%s\n\nSubcommands:\n", group, strings.Join(names, "|"), summary)
		for _, s := range subs {
			fmt.Fprintf(w, "  %-8s %s\n", s.name, s.summary)
		}
		fmt.Fprintf(w, "\nRun 'eventline %s <subcommand> -h' for its flags.\n", group)
		return errHelp
	}
	for _, s := range subs {
		if s.name == args[0] {
			inv.path = group + " " + s.name
			return s.run(ctx, args[1:])
		}
	}
	if strings.HasPrefix(args[0], "-") {
		return usageErrorf(group, "flags go after the subcommand (eventline %s <%s> %s ...)", group, strings.Join(names, "|"), args[0])
	}
	return usageErrorf(group, "unknown subcommand %q: want one of %s", args[0], strings.Join(names, ", "))
}
