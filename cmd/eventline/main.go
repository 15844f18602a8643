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
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		// After the first signal, restore the default handling: a second
		// Ctrl-C kills the process instead of waiting for a graceful stop.
		<-ctx.Done()
		stop()
	}()
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// run executes one eventline invocation with the process environment and
// returns its exit code. Tests call it in-process.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runWithEnv(ctx, args, stdout, stderr, os.Getenv)
}

// runWithEnv is run with the environment lookup injected.
func runWithEnv(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	inv := newInvocation(stdout, stderr, getenv)
	err := inv.main(withInvocation(ctx, inv), args)
	return inv.exitCode(err)
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
		return usageErrorf("", "%v", err)
	}
	args = fs.Args()
	if len(args) == 0 {
		return usageErrorf("", "no command given; the commands are: %s", strings.Join(commandNames(), ", "))
	}
	name, rest := args[0], args[1:]
	if name == "help" {
		return inv.help(ctx, rest)
	}
	cmd, ok := lookup(name)
	if !ok {
		return usageErrorf("", "unknown command %q; the commands are: %s", name, strings.Join(commandNames(), ", "))
	}
	inv.path = cmd.name
	return cmd.run(ctx, rest)
}

// help implements `eventline help [command]`.
func (inv *invocation) help(ctx context.Context, args []string) error {
	if len(args) == 0 {
		inv.printMainUsage(inv.stdout)
		return errHelp
	}
	cmd, ok := lookup(args[0])
	if !ok {
		return usageErrorf("", "unknown command %q; the commands are: %s", args[0], strings.Join(commandNames(), ", "))
	}
	inv.path = cmd.name
	return cmd.run(ctx, append(args[1:len(args):len(args)], "-h"))
}

// printMainUsage lists the commands and the global flags.
func (inv *invocation) printMainUsage(w io.Writer) {
	fmt.Fprintln(w, "Usage: eventline [global flags] <command> [flags] [arguments]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "eventline operates an eventline pipeline: PostgreSQL outbox -> relay -> Kafka -> consumers.")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Commands:")
	for _, c := range commands() {
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
	var ue *usageError
	var coded interface{ ExitCode() int }
	switch {
	case err == nil, errors.Is(err, errHelp):
		return exitOK
	case errors.As(err, &ue):
		path := "eventline"
		if ue.path != "" {
			path += " " + ue.path
		}
		fmt.Fprintf(inv.stderr, "%s: %s\n", path, ue.msg)
		fmt.Fprintf(inv.stderr, "Run '%s -h' for usage.\n", path)
		return exitUsage
	default:
		path := "eventline"
		if inv.path != "" {
			path += " " + inv.path
		}
		fmt.Fprintf(inv.stderr, "%s: %v\n", path, err)
		if errors.As(err, &coded) {
			return coded.ExitCode()
		}
		return exitFailure
	}
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
