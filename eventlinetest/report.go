package eventlinetest

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
)

// maxShrinkRuns bounds the extra runs spent looking for a smaller failing
// set of faults.
const maxShrinkRuns = 40

// maxListed bounds the lines of each list in a failure report.
const maxListed = 40

// Failure is a fault schedule under which the handler's effects differ
// from applying each event once, in order, or under which the handler
// failed where applying the events in order did not.
type Failure struct {
	// Seed replays the schedule: set Case.Seed, the -eventlinetest.seed
	// flag or EVENTLINETEST_SEED to it.
	Seed uint64
	// Trial is the schedule's number (from 1) among Trials.
	Trial, Trials int
	// Tests says what the schedule tests ("handler errors", "a random mix
	// of faults").
	Tests string
	// Layout describes the partitions the events were spread over.
	Layout string
	// Faults are the schedule's faults. Minimal is the smallest subset of
	// them found to fail as well; Deliveries and Got are from the run
	// with only those.
	Faults, Minimal []string
	// Deliveries says what happened, delivery by delivery.
	Deliveries []string
	// Err is why the schedule failed, when the handler failed rather than
	// left different effects.
	Err error
	// Want is the state after applying each event once, in order; Got is
	// the state after the schedule (nil when Err is set).
	Want, Got any

	test string
}

// Error formats the failure for a test log: the replay command, the
// faults, the deliveries and both states.
func (f *Failure) Error() string {
	var b strings.Builder
	if f.Err != nil {
		fmt.Fprintf(&b, "eventlinetest: under a fault schedule, %v\n", f.Err)
	} else {
		b.WriteString("eventlinetest: under a fault schedule, the handler's effects differ from applying each event once, in order\n")
	}
	test := cmp.Or(f.test, "TestName")
	fmt.Fprintf(&b, "  replay: go test -run '^%s$' -eventlinetest.seed=%#x   (or %s=%#x, or Case.Seed)\n", strings.ReplaceAll(test, "/", "$/^"), f.Seed, SeedEnv, f.Seed)
	fmt.Fprintf(&b, "  schedule: trial %d of %d, testing %s; %s\n", f.Trial, f.Trials, f.Tests, f.Layout)
	list := func(title string, lines []string) {
		fmt.Fprintf(&b, "  %s:\n", title)
		if len(lines) == 0 {
			b.WriteString("    (none)\n")
		}
		for i, l := range lines {
			if i == maxListed {
				fmt.Fprintf(&b, "    … and %d more\n", len(lines)-i)
				break
			}
			fmt.Fprintf(&b, "    %s\n", l)
		}
	}
	list("faults", bullets(f.Faults))
	if len(f.Minimal) < len(f.Faults) {
		list(fmt.Sprintf("smallest failing subset found (%d of %d)", len(f.Minimal), len(f.Faults)), bullets(f.Minimal))
	}
	list("deliveries", f.Deliveries)
	list("state after applying each event once, in order", stateLines(f.Want))
	if f.Err == nil {
		list("state after the schedule", stateLines(f.Got))
		if w, ok := f.Want.([]string); ok {
			if g, ok := f.Got.([]string); ok {
				list("difference (- only in order, + only after the schedule)", append(linesNotIn(w, g, "- "), linesNotIn(g, w, "+ ")...))
			}
		}
	}
	return strings.TrimRight(b.String(), "\n")
}

func bullets(lines []string) []string {
	out := make([]string, len(lines))
	for i, l := range lines {
		out[i] = "- " + l
	}
	return out
}

func stateLines(v any) []string {
	if l, ok := v.([]string); ok {
		if len(l) == 0 {
			return []string{"(no rows)"}
		}
		return l
	}
	return strings.Split(fmt.Sprintf("%+v", v), "\n")
}

// linesNotIn lists, each after prefix, the lines of a that b does not
// hold as often.
func linesNotIn(a, b []string, prefix string) []string {
	count := map[string]int{}
	for _, l := range b {
		count[l]++
	}
	var out []string
	for _, l := range a {
		if count[l] > 0 {
			count[l]--
			continue
		}
		out = append(out, prefix+l)
	}
	return out
}

// shrink looks for a smaller subset of s's faults that still fails, by
// removing chunks of them, halving the chunk size when no chunk can go
// (a simple delta debugging), within maxShrinkRuns runs.
func shrink(ctx context.Context, s schedule, r *result, want any, run runFunc) (schedule, *result, error) {
	runs := 0
	for size := max(len(s.faults)/2, 1); len(s.faults) > 0 && runs < maxShrinkRuns; {
		removed := false
		for i := 0; i < len(s.faults) && runs < maxShrinkRuns; {
			try := s.without(i, min(i+size, len(s.faults)))
			tr, err := run(ctx, try, want)
			runs++
			if err != nil {
				return s, r, err
			}
			if tr.failed() {
				s, r, removed = try, tr, true
				continue
			}
			i += size
		}
		if !removed {
			if size == 1 {
				break
			}
			size = max(size/2, 1)
		}
	}
	return s, r, nil
}

// runFunc runs one schedule.
type runFunc func(ctx context.Context, s schedule, want any) (*result, error)

// failure builds the report for a failing schedule, after looking for a
// smaller subset of its faults that fails too (when run is not nil).
func (k *kit) failure(ctx context.Context, s schedule, r *result, want any, trial, trials int, replay bool, run runFunc) (*Failure, error) {
	f := &Failure{
		Seed: s.seed, Trial: trial + 1, Trials: trials, Tests: k.tests(s.profile), Layout: k.layout(s),
		Want: want, test: k.testName,
	}
	if replay {
		f.Trial, f.Trials = 1, 1
	}
	for _, x := range s.faults {
		f.Faults = append(f.Faults, k.describe(x))
	}
	small, sr := s, r
	if run != nil {
		var err error
		if small, sr, err = shrink(ctx, s, r, want, run); err != nil {
			return nil, err
		}
	}
	for _, x := range small.faults {
		f.Minimal = append(f.Minimal, k.describe(x))
	}
	f.Deliveries = slices.Clone(sr.trace)
	f.Err, f.Got = sr.err, sr.got
	if f.Err != nil {
		f.Got = nil
	}
	return f, nil
}
