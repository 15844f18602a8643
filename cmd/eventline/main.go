// Command eventline is the operator CLI for eventline pipelines: it migrates
// the schema, runs the outbox relay, reports the pipeline's state, and
// repairs what an operator may need to repair (dead letters, parked events,
// retention).
//
// Run `eventline -h` for the commands and `eventline <command> -h` for each
// command's flags. Exit codes: 0 success, 1 failure, 2 usage error, 3
// `eventline verify` found a problem.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		// After the first signal, restore the default handling: a second
		// Ctrl-C kills the process instead of waiting for a graceful stop.
		<-ctx.Done()
		stop()
	}()
	code := runWithEnv(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// runWithEnv executes one eventline invocation, with getenv for the
// environment, and returns its exit code. Tests call it in-process.
func runWithEnv(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	inv := &invocation{stdout: stdout, stderr: stderr, getenv: getenv, globals: globalsFromEnv(getenv)}
	return inv.exitCode(inv.main(ctx, args))
}

// invocation is one run of the CLI: where output goes, the environment, the
// global flags, and the command being run with its flags and arguments.
type invocation struct {
	stdout, stderr io.Writer
	getenv         func(string) string
	globals        *globals

	// path is the command being run ("held list"), for messages.
	path string
	cmd  *command
	fs   *flagSet
	args []string
	// asJSON and limit are the -json and -limit flags of a command that
	// has them (jsonFlag, limitFlag).
	asJSON *bool
	limit  *int
	// pools are the connection pools the command opened, closed when it
	// returns.
	pools []*pgxpool.Pool

	logOnce sync.Once
	log     *slog.Logger
}

// errHelp is returned after help was printed on request; the exit code is 0.
var errHelp = errors.New("help requested")

// usageError is a mistake in the command line: the exit code is 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

// usageErrorf returns a usage error; main names the command it is about.
func usageErrorf(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// main parses the global flags, then runs the named command.
func (inv *invocation) main(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("eventline", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	inv.globals.register(fs)
	switch err := fs.Parse(args); {
	case errors.Is(err, flag.ErrHelp):
		inv.printMainUsage(inv.stdout)
		return errHelp
	case err != nil:
		return usageErrorf("%v", err)
	}
	args = fs.Args()
	if len(args) == 0 {
		return usageErrorf("no command given; the commands are: %s", strings.Join(names(commands), ", "))
	}
	name, rest := args[0], args[1:]
	if name == "help" { // eventline help [command [subcommand]]
		if len(rest) == 0 {
			inv.printMainUsage(inv.stdout)
			return errHelp
		}
		name, rest = rest[0], append(rest[1:len(rest):len(rest)], "-h")
	}
	cmd := find(commands, name)
	if cmd == nil {
		return usageErrorf("unknown command %q; the commands are: %s", name, strings.Join(names(commands), ", "))
	}
	return inv.runCommand(ctx, cmd, cmd.name, rest)
}

// printMainUsage lists the commands and the global flags.
func (inv *invocation) printMainUsage(w io.Writer) {
	fmt.Fprintln(w, "Usage: eventline [global flags] <command> [flags] [arguments]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "eventline operates an eventline pipeline: PostgreSQL outbox -> relay -> Kafka -> consumers.")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Commands:")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Global flags (accepted before or after the command):")
	fs := flag.NewFlagSet("eventline", flag.ContinueOnError)
	inv.globals.register(fs)
	printFlags(w, fs, func(string) bool { return true })
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Run 'eventline <command> -h' for a command's flags.")
	fmt.Fprintln(w, "Exit codes: 0 success, 1 failure, 2 usage error, 3 verify found a problem.")
}

// exitCode reports err on stderr and maps it to an exit code: a command's
// own when the error has an ExitCode method, else 1 (2 for usage errors).
func (inv *invocation) exitCode(err error) int {
	if err == nil || errors.Is(err, errHelp) {
		return exitOK
	}
	path := strings.TrimSpace("eventline " + inv.path)
	fmt.Fprintf(inv.stderr, "%s: %v\n", path, err)
	var ue *usageError
	var coded interface{ ExitCode() int }
	switch {
	case errors.As(err, &ue):
		fmt.Fprintf(inv.stderr, "Run '%s -h' for usage.\n", path)
		return exitUsage
	case errors.As(err, &coded):
		return coded.ExitCode()
	}
	return exitFailure
}

// newLogger builds the logger the global -log-level and -log-format flags
// ask for, writing to w.
func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("-log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	default:
		return nil, fmt.Errorf("-log-format %q: want text or json", format)
	}
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
