package eventlinetest

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
)

// ledger is a small case: three accounts, four versions each, an
// order-sensitive idempotent handler.
func ledger(t *testing.T) *kit {
	t.Helper()
	var events []eventline.Event
	for v := 1; v <= 4; v++ {
		for _, a := range []string{"a", "b", "c"} {
			e, err := eventline.NewJSONEvent("account.changed", "account", a, map[string]int{"v": v})
			require.NoError(t, err)
			events = append(events, e)
		}
	}
	k, err := prepare(Case{
		Setup: SQL(`CREATE TABLE acc (id text PRIMARY KEY, value bigint NOT NULL)`),
		Handlers: map[string]consumer.HandlerFunc{"account.changed": func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
			_, err := tx.Exec(ctx, `INSERT INTO acc VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET value = acc.value * 3 + $2`, e.AggregateID, e.AggregateVersion)
			return err
		}},
		Events: events,
		State:  Rows(`SELECT id, value FROM acc ORDER BY id`),
	}, t.Name())
	require.NoError(t, err)
	return k
}

// TestLogsHoldEveryEventInVersionOrderExceptTheFaults checks the
// generator over many seeds: every event sits on its aggregate's
// partition; copies follow their original; only a withheld version comes
// after a later version of its aggregate, and right after the version it
// waits for.
func TestLogsHoldEveryEventInVersionOrderExceptTheFaults(t *testing.T) {
	k := ledger(t)
	for i := range 500 {
		s := k.schedule(mix(uint64(i)))
		logs := k.logs(s)
		withheld := map[int]int{}
		for _, f := range s.faults {
			if f.kind == Withholding {
				withheld[f.event] = f.after
			}
		}
		seen := map[int]int{}
		for p, log := range logs {
			for pos, e := range log {
				require.Equal(t, p, s.partOf[k.aggOf[e]], "seed %d: event %d on the wrong partition", i, e)
				seen[e]++
				if seen[e] > 1 {
					continue // a copy
				}
				if after, ok := withheld[e]; ok {
					require.Less(t, slices.Index(log, after), pos, "seed %d: withheld event %d must come after %d", i, e, after)
					continue
				}
				// Every earlier version of the aggregate came before,
				// unless it was withheld.
				for _, prev := range k.aggs[k.aggOf[e]] {
					if prev >= e {
						break
					}
					if _, w := withheld[prev]; !w {
						require.Contains(t, log[:pos], prev, "seed %d: event %d before its predecessor %d", i, e, prev)
					}
				}
			}
		}
		for e := range k.Events {
			require.Equal(t, 1+countDup(s, e), seen[e], "seed %d: event %d", i, e)
		}
	}
}

func countDup(s schedule, e int) int {
	n := 0
	for _, f := range s.faults {
		if f.kind == Duplicates && f.event == e {
			n++
		}
	}
	return n
}

// TestEachProfileInjectsItsFault runs one schedule of each single-fault
// profile and checks, in its trace, that the fault happened.
func TestEachProfileInjectsItsFault(t *testing.T) {
	k := ledger(t)
	ctx := t.Context()
	var err error
	k.env, err = newSchema(ctx, k.DatabaseURL, k.Setup)
	require.NoError(t, err)
	defer k.env.close(ctx)
	want, err := k.reference(ctx)
	require.NoError(t, err)
	n := len(k.Events)
	for _, p := range faultClasses {
		t.Run(p.fault.String(), func(t *testing.T) {
			s := k.schedule(mix(uint64(p.id))&^0xff | uint64(p.id))
			r, err := k.runDirect(ctx, s, want)
			require.NoError(t, err)
			trace := strings.Join(r.trace, "\n")
			require.False(t, r.failed(), "an idempotent handler passes; trace:\n%s\nerr: %v", trace, r.err)
			t.Logf("%s; %d faults\n%s", k.layout(s), len(s.faults), trace)
			count := func(sub string) int { return strings.Count(trace, sub) }
			switch p.fault {
			case Duplicates:
				require.Equal(t, n, count("duplicate, skipped"), "every event delivered twice")
			case Reordering:
				require.True(t, s.reverse)
				first := r.trace[0]
				require.Contains(t, first, "account/c v1", "the last aggregate goes first")
			case Withholding:
				require.Positive(t, count("; parked"))
				require.Equal(t, len(k.aggs), count("; released "), "one withheld version per aggregate releases its successors")
			case Crashes:
				require.Positive(t, count("-- crash"))
			case Rebalances:
				require.Positive(t, count("-- rebalance"))
				require.Positive(t, count("(in flight on the old owner) deliver"))
			case HandlerErrors:
				require.Equal(t, n, count("(then an injected failure)"), "every first run fails")
				require.Equal(t, n, count(". retry "))
			case Batches:
				require.Positive(t, count(". batch of "))
				require.Zero(t, count("handler did not run"), "every member reached the handler")
				require.Equal(t, n, count("the AfterCommit hook of "), "every event's first committed run's hook panicked, and the trial went on")
			}
		})
	}
}

// TestSeedsStartWithOneTrialPerFaultClass: the first trials cover each
// enabled class alone, the rest mix them, and the profile survives in the
// seed so that a seed alone replays its schedule.
func TestSeedsStartWithOneTrialPerFaultClass(t *testing.T) {
	k := ledger(t)
	k.Faults, k.Trials = Duplicates|Crashes, 5
	seeds, replay := k.seeds()
	require.False(t, replay)
	var got []string
	for _, s := range seeds {
		got = append(got, profile(s&0xff).String())
	}
	require.Equal(t, []string{"duplicates", "crashes", "a random mix of faults", "every fault class at once", "a random mix of faults"}, got)
	for _, s := range seeds {
		for _, f := range k.schedule(s).faults {
			require.NotZero(t, f.kind&(Duplicates|Crashes), "seed %#x: fault %v is not enabled", s, f.kind)
		}
		require.Equal(t, fmt.Sprint(k.schedule(s)), fmt.Sprint(k.schedule(s)), "a seed gives one schedule")
	}
	k.Seed = seeds[3]
	again, replay := k.seeds()
	require.True(t, replay)
	require.Equal(t, []uint64{seeds[3]}, again)
}
