package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/admin/verify"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/sqlident"
)

// exitProblems is verify's exit code when it found a problem: distinct from
// exitFailure (it could not check), so a canary can tell the two apart.
const exitProblems = 3

// envConsumerDatabaseURL is the environment variable -consumer-database-url
// defaults to.
const envConsumerDatabaseURL = "EVENTLINE_CONSUMER_DATABASE_URL"

// problemsFound is returned by verify when the report is not OK; the
// report itself is already printed.
type problemsFound struct {
	problems, warnings int64
	strict             bool
}

func (e *problemsFound) Error() string {
	if e.problems == 0 && e.strict {
		return fmt.Sprintf("found %s (failing, -strict); see the report above", plural(e.warnings, "warning"))
	}
	return fmt.Sprintf("found %s; see the report above", plural(e.problems, "problem"))
}

// ExitCode is exitProblems.
func (e *problemsFound) ExitCode() int { return exitProblems }

const verifyHelp = `
Checks, against the data, that the pipeline kept its promises: for every event
committed in the window (default: everything retained) and every consumer
group that consumes its topic, it reconciles the outbox and the relay's dead
letters, what Kafka holds (read from the oldest offset to the high watermark,
when brokers are given), and the group's dedup records, versions, parked events
and skipped gaps. It reports per group:

  pending        committed, not applied yet, with its age (a problem once
                 older than -max-pending: stuck)
  lost           relayed, never applied, while the group moved past it (its
                 version of the aggregate, or its Kafka offset), with no dead
                 letter or skipped range to explain it; or not on Kafka at all
  discarded      discarded as stale while another event, with another id, had
                 been applied at its version: two events claim one version
  applied twice  from the group's own effects (-effects-query)
  out of order   a version applied after a higher one of its aggregate
  parked         waiting for a missing version, and why (a problem once older
                 than -max-parked)
  skipped        versions the group gave up on (a warning)
  dead letters   not replayed: the relay's, and the group's (eventline held)

Events without a dedup record committed before now minus -dedup-retention are
unverifiable (retention may have deleted the record), never lost. It only
reads, in read-only transactions that do not hold back the relays.

-effects-query GROUP=SQL runs your query, which returns one row per effect the
group applied: the event id, and optionally a column that grows with the time
of the effect (a bigserial, a timestamp) to check the order exactly.

Exit codes: 0 nothing wrong, 3 a problem found (or, with -strict, a warning),
1 the check could not run, 2 usage error. Run it in CI or cron as a canary.`

func runVerify(ctx context.Context, inv *invocation) error {
	fs := inv.fs
	var since, until time.Time
	fs.Func("since", "check what happened from `T` on: a duration ago (24h) or an RFC 3339 time (default: all retained data)", timeFlag(&since))
	fs.Func("until", "check what happened before `T`: a duration ago or an RFC 3339 time (default: now)", timeFlag(&until))
	var groups []string
	fs.Func("group", "check only consumer group `G` (repeatable; default every group found)", func(s string) error {
		if s == "" {
			return errors.New("empty value")
		}
		groups = append(groups, s)
		return nil
	})
	groupTopics, effects := map[string][]string{}, map[string]string{}
	fs.Func("group-topics", "`G=T1,T2`: the Kafka topics group G consumes (repeatable; default: its Kafka consumer group's\ncommitted offsets, else the topics of the events it has records of)",
		perGroupFlag(groupTopics, kafkaconf.ParseBrokers)) // a comma-separated list
	fs.Func("effects-query", "`G=SQL`: a query over group G's own effects returning event_id[, ordering column] (repeatable)",
		perGroupFlag(effects, func(sql string) string { return sql }))
	consumerURL := inv.getenv(envConsumerDatabaseURL)
	fs.Var(&secretURL{&consumerURL}, "consumer-database-url", "`URL` of the database holding the consumer tables, when not -database-url (env "+envConsumerDatabaseURL+")")
	consumerSchema := fs.String("consumer-schema", "", "schema of the consumer tables (default -schema)")
	maxPending := fs.Duration("max-pending", verify.DefaultMaxPendingAge, "an event not applied for longer is stuck (a problem)")
	maxParked := fs.Duration("max-parked", verify.DefaultMaxParkedAge, "an event parked for longer is a problem")
	dedupRetention := fs.Duration("dedup-retention", verify.DefaultDedupRetention, "the retention `eventline cleanup` keeps dedup records for")
	maxDetails := fs.Int("max-details", verify.DefaultMaxDetails, "findings listed per kind and group (the oldest); the rest are counted")
	noKafka := fs.Bool("no-kafka", false, "do not read Kafka even when -brokers or KAFKA_BROKERS is set")
	strict := fs.Bool("strict", false, "fail (exit 3) on warnings too")
	inv.jsonFlag("print JSON (stable field names, for scripts) instead of text")
	if _, err := inv.parse(); err != nil {
		return err
	}
	switch {
	case *maxPending <= 0 || *maxParked <= 0 || *dedupRetention <= 0:
		return usageErrorf("-max-pending, -max-parked and -dedup-retention must be positive")
	case *maxDetails < 0:
		return usageErrorf("-max-details must not be negative")
	case !since.IsZero() && !until.IsZero() && !since.Before(until):
		return usageErrorf("-since (%s) must be before -until (%s)", since.Format(time.RFC3339), until.Format(time.RFC3339))
	}
	if *consumerSchema != "" {
		if err := sqlident.Validate("-consumer-schema", *consumerSchema); err != nil {
			return usageErrorf("%v", err)
		}
	}
	g := inv.globals
	cfg := verify.Config{
		Schema: g.schema, ConsumerSchema: *consumerSchema, Since: since, Until: until, Groups: groups,
		GroupTopics: groupTopics, EffectsQueries: effects, MaxPendingAge: *maxPending, MaxParkedAge: *maxParked, DedupRetention: *dedupRetention,
		MaxDetails: *maxDetails, Logger: inv.logger(),
	}
	if *maxDetails == 0 {
		cfg.MaxDetails = verify.NoDetails
	}
	if !*noKafka && g.brokers != "" {
		var err error
		if cfg.Brokers, err = g.brokerList(); err != nil {
			return usageErrorf("%v", err)
		}
	}

	pool, err := inv.pool(ctx)
	if err != nil {
		return err
	}
	var consumerDB admin.Beginner
	if consumerURL != "" {
		db := database{url: consumerURL, what: "the consumer database", flag: "-consumer-database-url (or " + envConsumerDatabaseURL + ")"}
		if consumerDB, err = inv.openPool(ctx, db, 2); err != nil {
			return err
		}
	}

	rep, err := verify.Run(ctx, pool, consumerDB, cfg)
	if err != nil {
		return err
	}
	if err := inv.output(rep, func(w io.Writer) error { return writeVerifyText(w, rep) }); err != nil {
		return err
	}
	if !rep.OK || (*strict && rep.Warnings > 0) {
		return &problemsFound{problems: rep.Problems, warnings: rep.Warnings, strict: *strict}
	}
	return nil
}

// timeFlag returns a flag.Func that reads a point in time into t: a
// duration ago (24h) or an RFC 3339 time.
func timeFlag(t *time.Time) func(string) error {
	return func(s string) error {
		if d, err := time.ParseDuration(s); err == nil {
			if d < 0 {
				return fmt.Errorf("%s is negative: give how long ago, like 24h", s)
			}
			*t = time.Now().Add(-d)
			return nil
		}
		for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05", "2006-01-02"} {
			if pt, err := time.Parse(layout, s); err == nil {
				*t = pt
				return nil
			}
		}
		return fmt.Errorf("%q is neither a duration ago (24h, 90m) nor an RFC 3339 time (2006-01-02T15:04:05Z)", s)
	}
}

// perGroupFlag returns a flag.Func that reads a repeatable GROUP=VALUE flag
// into m, each group once, the value through parse.
func perGroupFlag[V any](m map[string]V, parse func(string) V) func(string) error {
	return func(s string) error {
		k, v, ok := strings.Cut(s, "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if !ok || k == "" || v == "" {
			return fmt.Errorf("want GROUP=VALUE, got %q", s)
		}
		if _, dup := m[k]; dup {
			return fmt.Errorf("group %q given twice", k)
		}
		m[k] = parse(v)
		return nil
	}
}
