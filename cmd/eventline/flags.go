package main

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"strings"

	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// Environment variables the global flags default to.
const (
	envDatabaseURL = "DATABASE_URL"
	envSchema      = "EVENTLINE_SCHEMA"
	envBrokers     = kafkaconf.BrokersEnv
)

// defaultDatabaseURL is used when neither -database-url nor DATABASE_URL is
// given: the local development database.
const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// globals is the configuration every command shares. Each field comes from
// its flag, else its environment variable, else the default.
type globals struct {
	databaseURL string
	schema      string
	brokers     string
	logLevel    string
	logFormat   string
}

func globalsFromEnv(getenv func(string) string) *globals {
	return &globals{
		databaseURL: cmp.Or(getenv(envDatabaseURL), defaultDatabaseURL),
		schema:      cmp.Or(getenv(envSchema), migrations.DefaultSchema),
		brokers:     getenv(envBrokers),
		logLevel:    "info",
		logFormat:   "text",
	}
}

// globalNames are the flags register defines.
var globalNames = map[string]bool{"database-url": true, "schema": true, "brokers": true, "log-level": true, "log-format": true}

// register defines the global flags on fs, with the current values as
// defaults, so they are accepted before the command and after it.
func (g *globals) register(fs *flag.FlagSet) {
	fs.Var(&secretURL{&g.databaseURL}, "database-url",
		"PostgreSQL connection `URL` (env "+envDatabaseURL+"; a password is not shown here)")
	fs.StringVar(&g.schema, "schema", g.schema,
		"PostgreSQL schema holding eventline's tables (env "+envSchema+")")
	fs.StringVar(&g.brokers, "brokers", g.brokers,
		"comma-separated Kafka brokers, host:port (env "+envBrokers+"); used by relay, verify and parked list")
	fs.StringVar(&g.logLevel, "log-level", g.logLevel, "log level: debug, info, warn or error")
	fs.StringVar(&g.logFormat, "log-format", g.logFormat, "log format on stderr: text or json")
}

// validate checks the global flags that every command relies on.
func (g *globals) validate() error {
	if err := sqlident.Validate("-schema", g.schema); err != nil {
		return err
	}
	if _, err := newLogger(io.Discard, g.logLevel, g.logFormat); err != nil {
		return err
	}
	return nil
}

// brokerList returns the Kafka brokers, checked to look like host:port.
func (g *globals) brokerList() ([]string, error) {
	brokers := kafkaconf.ParseBrokers(g.brokers)
	if len(brokers) == 0 {
		return nil, errors.New("no Kafka brokers: pass -brokers host:port or set " + envBrokers +
			" (for local development, `eventline kafka-dev` runs an in-process Kafka and prints the value to use)")
	}
	if err := kafkaconf.ValidateBrokers("-brokers", brokers); err != nil {
		return nil, err
	}
	return brokers, nil
}

// secretURL is a flag.Value for a connection URL whose String hides the
// password, so -h never prints it.
type secretURL struct{ p *string }

func (s *secretURL) Set(v string) error { *s.p = v; return nil }

func (s *secretURL) String() string {
	if s == nil || s.p == nil {
		return ""
	}
	return redactURL(*s.p)
}

// redactURL hides the password in a PostgreSQL URL or key=value DSN.
func redactURL(raw string) string {
	if u, err := url.Parse(raw); err == nil && u.Scheme != "" {
		return u.Redacted()
	}
	if strings.Contains(raw, "password") {
		return "(connection string with a password)"
	}
	return raw
}

// flagSet is a command's flags plus the global ones. Flags may come before
// and after positional arguments; "--" ends them.
type flagSet struct {
	*flag.FlagSet
	inv *invocation
}

// newFlagSet returns the flags of the command inv runs, with the global
// ones defined.
func newFlagSet(inv *invocation) *flagSet {
	fs := flag.NewFlagSet("eventline "+inv.path, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	inv.globals.register(fs)
	return &flagSet{FlagSet: fs, inv: inv}
}

// parse parses the command's arguments and returns the positional ones,
// refusing any for a command that takes none. It returns errHelp after
// printing the usage for -h, and a usage error for anything malformed,
// including invalid global flags.
func (inv *invocation) parse() ([]string, error) {
	f, args := inv.fs, inv.args
	var positional []string
	for {
		err := f.Parse(args)
		if errors.Is(err, flag.ErrHelp) {
			f.usage(inv.stdout)
			return nil, errHelp
		}
		if err != nil {
			return nil, usageErrorf("%v", err)
		}
		rest := f.Args()
		consumed := len(args) - len(rest)
		if consumed > 0 && args[consumed-1] == "--" {
			positional = append(positional, rest...)
			break
		}
		if len(rest) == 0 {
			break
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
	if err := inv.globals.validate(); err != nil {
		return nil, usageErrorf("%v", err)
	}
	if len(positional) > 0 && !inv.cmd.positional {
		return nil, usageErrorf("%s takes no arguments, got %q", inv.path, positional)
	}
	if inv.limit != nil && *inv.limit < 1 {
		return nil, usageErrorf("-limit must be at least 1, got %d", *inv.limit)
	}
	return positional, nil
}

// isSet reports whether the flag was given on the command line.
func (f *flagSet) isSet(name string) bool {
	set := false
	f.Visit(func(fl *flag.Flag) { set = set || fl.Name == name })
	return set
}

// usage prints the command's help and flags.
func (f *flagSet) usage(w io.Writer) {
	fmt.Fprintln(w, strings.TrimSpace("Usage: eventline "+f.inv.path+" "+f.inv.cmd.usage))
	if help := strings.TrimSpace(f.inv.cmd.help); help != "" {
		fmt.Fprintln(w)
		fmt.Fprintln(w, help)
	}
	own := false
	f.VisitAll(func(fl *flag.Flag) { own = own || !globalNames[fl.Name] })
	if own {
		fmt.Fprintln(w)
		fmt.Fprintln(w, "Flags:")
		printFlags(w, f.FlagSet, func(name string) bool { return !globalNames[name] })
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Global flags:")
	printFlags(w, f.FlagSet, func(name string) bool { return globalNames[name] })
}

// aggregateFlag parses an -aggregate flag, TYPE/ID; empty means every
// aggregate.
func aggregateFlag(s string) (typ, id string, err error) {
	if s == "" {
		return "", "", nil
	}
	typ, id, ok := parseAggregate(s)
	if !ok {
		return "", "", usageErrorf("-aggregate %q: want TYPE/ID, e.g. order/42", s)
	}
	return typ, id, nil
}

// parseAggregate splits "type/id" at the first slash.
func parseAggregate(s string) (typ, id string, ok bool) {
	typ, id, ok = strings.Cut(s, "/")
	return typ, id, ok && typ != "" && id != ""
}

// printFlags prints the flags filter accepts, like flag.PrintDefaults, but
// stating every non-empty default.
func printFlags(w io.Writer, fs *flag.FlagSet, filter func(string) bool) {
	fs.VisitAll(func(fl *flag.Flag) {
		if !filter(fl.Name) {
			return
		}
		typ, usage := flag.UnquoteUsage(fl)
		line := "  -" + fl.Name
		if typ != "" {
			line += " " + typ
		}
		usage = strings.ReplaceAll(usage, "\n", "\n    \t")
		switch {
		case fl.DefValue == "" || fl.DefValue == "false":
		case typ == "string" || typ == "URL":
			usage += fmt.Sprintf(" (default %q)", fl.DefValue)
		default:
			usage += fmt.Sprintf(" (default %s)", fl.DefValue)
		}
		fmt.Fprintf(w, "%s\n    \t%s\n", line, usage)
	})
}
