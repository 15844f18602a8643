package main

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestUsageErrorsExit2WithAHint(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string // in stderr
	}{
		{nil, "eventline: no command given; the commands are: "},
		{[]string{"frobnicate"}, `unknown command "frobnicate"`},
		{[]string{"-nope", "status"}, "flag provided but not defined: -nope"},
		{[]string{"status", "-nope"}, "eventline status: flag provided but not defined: -nope"},
		{[]string{"status", "extra"}, `status takes no arguments, got ["extra"]`},
		{[]string{"status", "-schema", "bad-name"}, "-schema"},
		{[]string{"status", "-log-level", "loud"}, `-log-level "loud": want debug, info, warn or error`},
		{[]string{"status", "-database-url", "postgres://h:notaport/db"}, "is not a valid PostgreSQL URL"},
		{[]string{"migrate"}, "eventline migrate: missing subcommand: one of up, down, status"},
		{[]string{"migrate", "sideways"}, `unknown subcommand "sideways"`},
		{[]string{"migrate", "-schema", "x", "up"}, "flags go after the subcommand"},
		{[]string{"migrate", "up", "-shards", "5000"}, "-shards must be between 1 and 1024"},
		{[]string{"migrate", "down", "-steps", "0"}, "-steps must be at least 1"},
		{[]string{"migrate", "down", "-all", "-steps", "2"}, "give -steps or -all, not both"},
		{[]string{"relay"}, "no Kafka brokers: pass -brokers host:port or set KAFKA_BROKERS"},
		{[]string{"relay", "-brokers", "nohostport"}, `broker "nohostport" is not host:port`},
		{[]string{"relay", "-brokers", "h:1", "-backoff-initial", "soon"}, `invalid value "soon" for flag -backoff-initial`},
		{[]string{"relay", "-brokers", "h:1", "-backoff-initial", "2s", "-backoff-max", "1s"}, `-backoff-max (1s) must not be below -backoff-initial (2s)`},
		{[]string{"relay", "-brokers", "h:1", "-backoff-multiplier", "0.5"}, `-backoff-multiplier must be at least 1, got 0.5`},
		{[]string{"relay", "-brokers", "h:1", "-max-attempts", "0"}, "-max-attempts must be at least 1"},
		{[]string{"relay", "-brokers", "h:1", "-retention", "0s"}, "-retention must be positive"},
		{[]string{"relay", "-brokers", "h:1", "-cleanup-interval", "-1s"}, "0 disables cleanup"},
		{[]string{"held", "list", "-limit", "0"}, "-limit must be at least 1"},
		{[]string{"held", "list", "-kind", "parked"}, `-kind "parked": want relay_dead_letter, dead_letter or late`},
		{[]string{"held", "list", "-status", "dead"}, `-status "dead": want open, held`},
		{[]string{"held", "replay"}, "give the ids of the held events"},
		{[]string{"held", "replay", "-all", "3"}, "give held event ids or -all, not both"},
		{[]string{"held", "replay", "three"}, `"three" is not a held event id`},
		{[]string{"held", "replay", "x"}, `"x" is not a held event id`},
		{[]string{"held", "replay", "-all", "-group", "g", "3"}, "not both"},
		{[]string{"held", "list", "-status", "sleepy"}, `-status "sleepy"`},
		{[]string{"held", "list", "-aggregate", "noslash"}, "want TYPE/ID"},
		{[]string{"held", "replay", "-all"}, "-all needs -kind, -group or -aggregate"},
		{[]string{"held", "discard", "-all", "-group", "g"}, "-reason is required"},
		{[]string{"held", "discard", "-reason", "r", "-aggregate", "x", "1"}, `-aggregate "x": want TYPE/ID`},
		{[]string{"parked", "list", "-aggregate", "noslash"}, "want TYPE/ID"},
		{[]string{"parked", "release", "billing"}, "want exactly two arguments"},
		{[]string{"parked", "release", "-reason", "x", "billing", "order"}, `"order" is not <aggregate_type>/<aggregate_id>`},
		{[]string{"parked", "release", "billing", "order/1"}, "-reason is required"},
		{[]string{"cleanup", "-only", "everything"}, `-only "everything": want outbox or dedup`},
		{[]string{"cleanup", "-dedup-retention", "5s"}, "-dedup-retention must be at least 1m0s"},
		{[]string{"cleanup", "-only", "outbox", "-group", "g"}, "-group applies to dedup records"},
		{[]string{"kafka-dev", "-port", "70000"}, "-port must be between 0 and 65535"},
		{[]string{"kafka-dev", "-topics", "bad topic"}, "-topics"},
		{[]string{"version", "now"}, "version takes no arguments"},
	} {
		t.Run(strings.Join(tc.args, "_"), func(t *testing.T) {
			t.Parallel()
			r := cli(t, tc.args...)
			require.Equal(t, exitUsage, r.code)
			require.Contains(t, r.stderr, tc.want)
			require.Regexp(t, `Run 'eventline[a-z -]*-h' for usage\.\n$`, r.stderr, "every usage error says where help is")
			require.Empty(t, r.stdout)
		})
	}
}

func TestHelpExits0AndDocumentsDefaults(t *testing.T) {
	t.Parallel()
	r := cli(t, "-h")
	require.Equal(t, exitOK, r.code)
	for _, name := range []string{"migrate", "relay", "status", "held", "parked", "cleanup", "kafka-dev", "version"} {
		require.Regexp(t, `(?m)^  `+name+` +\S`, r.stdout, "the command list names %s", name)
	}
	require.Contains(t, r.stdout, `-database-url URL`)
	require.Contains(t, r.stdout, `(default "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")`)
	require.Contains(t, r.stdout, "(env KAFKA_BROKERS)")

	r = cli(t, "relay", "-h")
	require.Equal(t, exitOK, r.code)
	for _, want := range []string{
		"Usage: eventline relay [flags]",
		"-batch-size int", "(default 500)",
		"-poll-interval duration", "(default 5s)",
		"-max-publish-rate float", "0 means no cap",
		"-backoff-initial duration", "(default 1s)",
		"-backoff-multiplier float", "(default 5)",
		"-backoff-max duration", "(default 10m0s)",
		"-max-attempts int", "(default 5)",
		"-retention duration", "(default 24h0m0s)",
		"-cleanup-interval duration", "0 disables", "(default 5m0s)",
		"-metrics-addr ADDR",
		"Global flags:", "-schema string",
	} {
		require.Contains(t, r.stdout, want)
	}

	for _, args := range [][]string{{"help", "held"}, {"held", "-h"}, {"held", "help"}} {
		r = cli(t, args...)
		require.Equal(t, exitOK, r.code, "%v", args)
		require.Contains(t, r.stdout, "Usage: eventline held <list|replay|discard>")
	}
	r = cli(t, "help", "parked", "release")
	require.Equal(t, exitOK, r.code)
	require.Contains(t, r.stdout, "Usage: eventline parked release -reason TEXT <group> <aggregate_type>/<aggregate_id>")
}

func TestDatabaseErrorsExit1AndSayWhatToCheck(t *testing.T) {
	t.Parallel()
	r := cli(t, "-database-url", "postgres://nobody:secret@127.0.0.1:1/test?connect_timeout=5", "status")
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "eventline status: cannot connect to PostgreSQL at postgres://nobody:xxxxx@127.0.0.1:1/test")
	require.Contains(t, r.stderr, "check -database-url (or DATABASE_URL)")
	require.NotContains(t, r.stderr, "secret", "the password is never printed")
}

func TestGlobalsComeFromTheEnvironment(t *testing.T) {
	t.Parallel()
	env := map[string]string{
		"DATABASE_URL":     "postgres://u:pw@db.example:5432/app",
		"EVENTLINE_SCHEMA": "from_env",
		"KAFKA_BROKERS":    "k1:9092, k2:9092",
	}
	var out, errw syncBuffer
	code := runWithEnv(context.Background(), []string{"env-echo", "-schema", "from_flag"}, &out, &errw, func(k string) string { return env[k] })
	require.Equal(t, exitOK, code, errw.String())
	require.Equal(t, "url=postgres://u:pw@db.example:5432/app schema=from_flag brokers=[k1:9092 k2:9092] args=[]\n", out.String())

	out = syncBuffer{}
	code = runWithEnv(context.Background(), []string{"-schema", "before", "env-echo", "a", "-database-url", "postgres://x/y", "b"}, &out, &errw, noEnv)
	require.Equal(t, exitOK, code, errw.String())
	require.Equal(t, "url=postgres://x/y schema=before brokers=[] args=[a b]\n", out.String())
}

// env-echo is a command added to the table for the tests.
func init() {
	commands = append(commands, &command{name: "env-echo", summary: "(test) print the global configuration", usage: "[args]", positional: true,
		run: func(_ context.Context, inv *invocation) error {
			pos, err := inv.parse()
			if err != nil {
				return err
			}
			g := inv.globals
			brokers, _ := g.brokerList()
			if brokers == nil {
				brokers = []string{}
			}
			_, err = fmt.Fprintf(inv.stdout, "url=%s schema=%s brokers=%v args=%v\n", g.databaseURL, g.schema, brokers, append([]string{}, pos...))
			return err
		}})
}
