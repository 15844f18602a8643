package main

import (
	"context"
	"slices"
	"strings"

	"github.com/eventline/eventline/internal/bench"
	"github.com/eventline/eventline/internal/kafkaconf"
)

func init() {
	register(command{name: "bench", summary: "Benchmark eventline side by side with plain Watermill and a hand-written relay", run: runBench})
}

func runBench(ctx context.Context, args []string) error {
	fs := newFlagSet(ctx, "bench", "[-quick] [-scenarios list] [-profile dir]", `
Runs eventline side by side with plain Watermill (watermill-sql's default
PostgreSQL outbox and forwarder, watermill-kafka) and a hand-written
FOR UPDATE SKIP LOCKED relay, against the PostgreSQL of -database-url and the
Kafka of -brokers (an in-process kfake cluster when none is given).

Scenarios: producer_overhead, relay_drain, consumer_drain,
consumer_slow_handler, end_to_end_latency, idle_queries. Each creates its own schemas and topics and drops them when it
ends; -schema is not used.

Progress goes to stderr. stdout gets one table, eventline's figure next to the
baseline's, then one "ratio <name>=<x.xx>" line per figure (eventline ÷
baseline). Only ratios from one run compare: absolute figures depend on what
else the machine is doing. The full suite takes several minutes; -quick runs
smaller backlogs and shorter phases in under three minutes.`)
	quick := fs.Bool("quick", false, "run the smaller suite (smaller backlogs, shorter phases)")
	scenarios := fs.String("scenarios", "", "comma-separated `names` of the scenarios to run (default all)")
	profileDir := fs.String("profile", "", "write a CPU profile per measured phase, and block and mutex profiles, to `DIR`")
	pos, err := fs.parse(args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return fs.usageErrorf("bench takes no arguments, got %q", pos)
	}
	var names []string
	for name := range strings.SplitSeq(*scenarios, ",") {
		if name = strings.TrimSpace(name); name == "" {
			continue
		}
		if !slices.Contains(bench.Scenarios, name) {
			return fs.usageErrorf("-scenarios: unknown scenario %q; choose from %s", name, strings.Join(bench.Scenarios, ", "))
		}
		names = append(names, name)
	}
	g := globalsOf(ctx)
	brokers := kafkaconf.ParseBrokers(g.brokers)
	if len(brokers) > 0 {
		if err := kafkaconf.ValidateBrokers("-brokers", brokers); err != nil {
			return fs.usageErrorf("%v", err)
		}
	}
	_, err = bench.Run(ctx, bench.Config{
		Quick:       *quick,
		Scenarios:   names,
		DatabaseURL: g.databaseURL,
		Brokers:     brokers,
		ProfileDir:  *profileDir,
		Out:         stdout(ctx),
		Progress:    stderr(ctx),
	})
	return err
}
