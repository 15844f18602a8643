package main

import (
	"context"
	"fmt"
	"strings"
)

// commands is the CLI: every command and subcommand, in the order
// `eventline -h` lists them; the help text of each (cleanupHelp, ...) is in
// its file, next to its run function. A run function defines its flags on
// inv.fs (inv.jsonFlag and inv.limitFlag for -json and -limit), parses them
// with inv.parse, connects with inv.pool (closed when it returns), prints
// its result with inv.output or to inv.stdout and diagnostics to
// inv.stderr or inv.logger(), and returns usageErrorf(...) for bad
// arguments (exit code 2) or any other error for a failure (exit code 1,
// or the error's ExitCode()); main prints it.
var commands = []*command{
	{name: "cleanup", summary: "Delete relayed outbox rows and old dedup records past retention",
		usage: "[-only outbox|dedup] [-retention D] [-dedup-retention D] [-group G] [-batch N] [-dry-run]", help: cleanupHelp, run: runCleanup},
	{name: "held", summary: "List, replay and discard events held for the operator: dead letters and late events (list|replay|discard)",
		help: heldHelp, subs: []*command{
			{name: "list", summary: "List held events, oldest first", positional: true,
				usage: "[-kind K] [-group G] [-aggregate TYPE/ID] [-status S] [-limit N] [-json] [<id>...]", help: heldListHelp, run: heldList},
			{name: "replay", summary: "Replay held events (re-enqueue, or ask the group's running consumer)", positional: true,
				usage: "[-kind K] [-group G] [-aggregate TYPE/ID] (<id>... | -all)", help: heldReplayHelp, run: heldReplay},
			{name: "discard", summary: "Give up on held events, with a reason", positional: true,
				usage: "-reason TEXT [-kind K] [-group G] [-aggregate TYPE/ID] (<id>... | -all)", help: heldDiscardHelp, run: heldDiscard},
		}},
	{name: "kafka-dev", summary: "Run an in-process Kafka (kfake) for local development",
		usage: "[-port N] [-partitions N] [-topics a,b]", help: kafkaDevHelp, run: runKafkaDev},
	{name: "migrate", summary: "Apply, roll back or list the schema migrations (up|down|status)",
		help: "Manages eventline's tables in the -schema schema.", subs: []*command{
			{name: "up", summary: "Apply every pending migration and create the outbox shard tables",
				usage: "[-shards N]", help: migrateUpHelp, run: migrateUp},
			{name: "down", summary: "Roll back the newest migrations (refuses to drop unsent events)",
				usage: "[-steps N | -all] [-force]", help: migrateDownHelp, run: migrateDown},
			{name: "status", summary: "List the migrations and when each was applied",
				usage: "[-json] [-check]", help: migrateStatusHelp, run: migrateStatus},
		}},
	{name: "parked", summary: "Parked events of consumer groups and the gaps given up on (list|release|skipped)",
		help: parkedHelp, subs: []*command{
			{name: "list", summary: "List parked events with the versions they wait for", positional: true,
				usage: "[-group G] [-aggregate TYPE/ID] [-limit N] [-json]", help: parkedListHelp, run: parkedList},
			{name: "release", summary: "Give up on an aggregate's missing versions", positional: true,
				usage: "-reason TEXT <group> <aggregate_type>/<aggregate_id>", help: parkedReleaseHelp, run: parkedRelease},
			{name: "skipped", summary: "List the audit of versions given up on", positional: true,
				usage: "[-group G] [-aggregate TYPE/ID] [-limit N] [-json]", help: parkedSkippedHelp, run: parkedSkipped},
		}},
	{name: "relay", summary: "Relay outbox events to Kafka until interrupted",
		usage: "[flags] | rebase-positions | advance-sequences", help: relayHelp, run: runRelay, subs: []*command{
			{name: "rebase-positions", summary: "Re-base relay positions after a restore or cutover to another cluster",
				usage: "[-dry-run]", help: rebasePositionsHelp, run: relayRebasePositions},
			{name: "advance-sequences", summary: "Move aggregate sequences past the versions consumers have seen",
				usage: "[-consumer-database-url URL] [-consumer-schema S] [-dry-run]", help: advanceSequencesHelp, run: relayAdvanceSequences},
		}},
	{name: "status", summary: "Show backlog, shard owners, dead letters, parked events and dedup size",
		usage: "[-json]", help: statusHelp, run: runStatus},
	{name: "verify", summary: "Check the pipeline's guarantees against its data (exit 3 when broken)",
		usage: "[-since T] [-until T] [-group G]... [-group-topics G=T,T]... [-effects-query G=SQL]... [-json] [-strict]", help: verifyHelp, run: runVerify},
	{name: "version", summary: "Print the eventline version",
		help: "Prints the CLI's version, the eventline module version and the Go version it was built with.", run: runVersion},
}

// command is one eventline command or subcommand.
type command struct {
	// name is the word after `eventline` (or after its group's name).
	name string
	// summary is its line in `eventline -h` (or in its group's -h).
	summary string
	// usage follows "Usage: eventline <path>" in its -h; help is the text
	// under that line.
	usage, help string
	// positional says that it takes arguments after its flags; run checks
	// them. Without it, parse refuses any.
	positional bool
	// run executes it; nil for a group that only has subcommands.
	run func(ctx context.Context, inv *invocation) error
	// subs are a group's subcommands (held list, ...). A command with both
	// run and subs (relay) runs a subcommand when the first argument names
	// one, else itself.
	subs []*command
}

// find returns the command in list named name, or nil.
func find(list []*command, name string) *command {
	for _, c := range list {
		if c.name == name {
			return c
		}
	}
	return nil
}

// names returns the names of list, in order.
func names(list []*command) []string {
	var out []string
	for _, c := range list {
		out = append(out, c.name)
	}
	return out
}

// runCommand runs cmd, at path ("held list"), with the arguments after its
// name: a subcommand of a group, or cmd itself with its flags.
func (inv *invocation) runCommand(ctx context.Context, cmd *command, path string, args []string) error {
	inv.path = path
	if len(args) > 0 {
		if sub := find(cmd.subs, args[0]); sub != nil {
			return inv.runCommand(ctx, sub, path+" "+sub.name, args[1:])
		}
	}
	if cmd.run == nil {
		return inv.group(cmd, args)
	}
	inv.cmd, inv.args = cmd, args
	inv.fs = newFlagSet(inv)
	defer inv.closePools()
	return cmd.run(ctx, inv)
}

// group answers a group's arguments that name none of its subcommands:
// help, or a usage error saying what it wants.
func (inv *invocation) group(cmd *command, args []string) error {
	subs := names(cmd.subs)
	if len(args) == 0 {
		return usageErrorf("missing subcommand: one of %s", strings.Join(subs, ", "))
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		w := inv.stdout
		fmt.Fprintf(w, "Usage: eventline %s <%s> [flags] [arguments]\n\n%s\n\nSubcommands:\n", inv.path, strings.Join(subs, "|"), strings.TrimSpace(cmd.help))
		for _, s := range cmd.subs {
			fmt.Fprintf(w, "  %-8s %s\n", s.name, s.summary)
		}
		fmt.Fprintf(w, "\nRun 'eventline %s <subcommand> -h' for its flags.\n", inv.path)
		return errHelp
	}
	if strings.HasPrefix(args[0], "-") {
		return usageErrorf("flags go after the subcommand (eventline %s <%s> %s ...)", inv.path, strings.Join(subs, "|"), args[0])
	}
	return usageErrorf("unknown subcommand %q: want one of %s", args[0], strings.Join(subs, ", "))
}
