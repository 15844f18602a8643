// Command eventline-bench runs eventline side by side with plain Watermill
// (watermill-sql's default PostgreSQL outbox and forwarder, watermill-kafka)
// and a hand-written FOR UPDATE SKIP LOCKED relay, against a real
// PostgreSQL and Kafka (an in-process kfake cluster unless -brokers or
// KAFKA_BROKERS names one). See docs/BENCHMARKS.md.
//
// It is a tool of the repository, not of the library: a module of its own
// (run it from this directory, `go run .`, or with `make bench`) that uses
// only eventline's public API. The library module, its import graph and
// the eventline binary do not hold it.
//
// Exit codes: 0 success, 1 failure, 2 usage error.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/eventline/eventline/cmd/eventline-bench/internal/bench"
)

const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		// After the first signal a second one kills the process.
		<-ctx.Done()
		stop()
	}()
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}

const usageText = `Usage: eventline-bench [flags]

Runs eventline side by side with plain Watermill (watermill-sql's default
PostgreSQL outbox and forwarder, watermill-kafka) and a hand-written
FOR UPDATE SKIP LOCKED relay, against the PostgreSQL of -database-url and the
Kafka of -brokers (an in-process kfake cluster when none is given).

Scenarios: %s. Each creates its own schemas and topics and drops them when
it ends. Measured phases run on warm pools; cold starts are rows of their
own.

With a real broker, KAFKA_BROKER_PID (the broker's process id on this
machine) adds the broker's CPU share beside the pipeline's.

Progress goes to stderr. stdout gets one table, eventline's figure next to
the baseline's, then one "ratio <name>=<x.xx>" line per
figure (eventline ÷ baseline). Only ratios from one run compare: absolute
figures depend on what else the machine is doing. The full suite takes
several minutes; -quick runs smaller backlogs and shorter phases.

Flags:
`

// run executes one invocation and returns its exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	fs := flag.NewFlagSet("eventline-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), usageText, strings.Join(bench.Scenarios, ", "))
		fs.PrintDefaults()
	}
	dbURL := firstSet(getenv, "TEST_DATABASE_URL", "DATABASE_URL")
	if dbURL == "" {
		dbURL = bench.DefaultDatabaseURL
	}
	databaseURL := fs.String("database-url", dbURL, "PostgreSQL connection `URL` (env TEST_DATABASE_URL, then DATABASE_URL)")
	brokerList := fs.String("brokers", getenv(bench.BrokersEnv), "comma-separated Kafka `brokers`, host:port (env "+bench.BrokersEnv+"); empty starts kfake in-process")
	quick := fs.Bool("quick", false, "run the smaller suite (smaller backlogs, shorter phases)")
	scenarios := fs.String("scenarios", "", "comma-separated `names` of the scenarios to run (default all)")
	profileDir := fs.String("profile", "", "write a CPU profile per measured phase, and block and mutex profiles, to `DIR`")
	usage := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "eventline-bench: "+format+"\nRun 'eventline-bench -h' for usage.\n", a...)
		return exitUsage
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage // the flag package printed the error and the usage
	}
	if fs.NArg() > 0 {
		return usage("takes no arguments, got %q", fs.Args())
	}
	var names []string
	for name := range strings.SplitSeq(*scenarios, ",") {
		if name = strings.TrimSpace(name); name == "" {
			continue
		}
		if !slices.Contains(bench.Scenarios, name) {
			return usage("-scenarios: unknown scenario %q; choose from %s", name, strings.Join(bench.Scenarios, ", "))
		}
		names = append(names, name)
	}
	brokers := bench.ParseBrokers(*brokerList)
	if len(brokers) > 0 {
		if err := bench.ValidateBrokers("-brokers", brokers); err != nil {
			return usage("%v", err)
		}
	}
	var brokerPID int
	if v := getenv(bench.BrokerPIDEnv); v != "" {
		pid, err := strconv.Atoi(v)
		if err != nil || pid <= 0 {
			return usage("%s=%q is not a process id", bench.BrokerPIDEnv, v)
		}
		brokerPID = pid
	}
	_, err := bench.Run(ctx, bench.Config{
		Quick:       *quick,
		Scenarios:   names,
		DatabaseURL: *databaseURL,
		Brokers:     brokers,
		BrokerPID:   brokerPID,
		ProfileDir:  *profileDir,
		Out:         stdout,
		Progress:    stderr,
	})
	if err != nil {
		fmt.Fprintf(stderr, "eventline-bench: %v\n", err)
		return exitFailure
	}
	return exitOK
}

func firstSet(getenv func(string) string, keys ...string) string {
	for _, k := range keys {
		if v := getenv(k); v != "" {
			return v
		}
	}
	return ""
}
