package eventline_test

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin/verify"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/eventlinetest"
	"github.com/eventline/eventline/eventlinetest/kafkatest"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// TestDesignDefaultsMatchTheCode reads the "Defaults at a glance" table of
// docs/DESIGN.md and checks every row against the constant it names, so
// the table cannot drift from the code. A row naming a constant this test
// does not know fails too: add it here. The verify.* rows name the
// checker's constants (admin/verify), the defaults of `eventline
// verify`'s flags.
func TestDesignDefaultsMatchTheCode(t *testing.T) {
	want := map[string]string{
		"migrations.DefaultSchema":                         migrations.DefaultSchema,
		"migrations.DefaultShards":                         fmt.Sprint(migrations.DefaultShards),
		"producer.DefaultMaxMessageBytes":                  bytes(producer.DefaultMaxMessageBytes),
		"producer.DefaultBatchSize":                        fmt.Sprint(producer.DefaultBatchSize),
		"producer.DefaultPollInterval":                     human(producer.DefaultPollInterval),
		"producer.DefaultRebalanceInterval":                human(producer.DefaultRebalanceInterval),
		"producer.TakeoverBound(DefaultRebalanceInterval)": human(producer.TakeoverBound(producer.DefaultRebalanceInterval)),
		"producer.DefaultMaxAttempts":                      fmt.Sprint(producer.DefaultMaxAttempts),
		"producer.DefaultBackoffInitial":                   human(producer.DefaultBackoffInitial),
		"producer.DefaultBackoffMultiplier":                fmt.Sprint(producer.DefaultBackoffMultiplier),
		"producer.DefaultBackoffMax":                       human(producer.DefaultBackoffMax),
		"producer.DefaultRetentionWindow":                  human(producer.DefaultRetentionWindow),
		"producer.DefaultCleanupInterval":                  human(producer.DefaultCleanupInterval),
		"producer.DefaultCleanupBatchSize":                 fmt.Sprint(producer.DefaultCleanupBatchSize),
		"producer.DefaultPartitioner":                      string(producer.DefaultPartitioner),
		"producer.PoolSizeFor":                             fmt.Sprintf("shards + %d", producer.PoolSizeFor(0)),
		"consumer.DefaultLanes":                            fmt.Sprint(consumer.DefaultLanes),
		"consumer.DefaultBatchSize":                        fmt.Sprint(consumer.DefaultBatchSize),
		"consumer.DefaultBatchLinger":                      human(consumer.DefaultBatchLinger),
		"middleware.DefaultMaxRetries":                     fmt.Sprint(middleware.DefaultMaxRetries),
		"middleware.DefaultRetry.Initial":                  human(middleware.DefaultRetry.Initial),
		"middleware.DefaultRetry.Multiplier":               fmt.Sprint(middleware.DefaultRetry.Multiplier),
		"middleware.DefaultRetry.Max":                      human(middleware.DefaultRetry.Max),
		"middleware.DefaultRetry.Jitter":                   fmt.Sprint(middleware.DefaultRetry.Jitter),
		"middleware.DefaultInfraBackoff.Initial":           human(middleware.DefaultInfraBackoff.Initial),
		"middleware.DefaultInfraBackoff.Max":               human(middleware.DefaultInfraBackoff.Max),
		"middleware.DefaultTxTimeout":                      human(middleware.DefaultTxTimeout),
		"consumer.DefaultShutdownTimeout":                  human(consumer.DefaultShutdownTimeout),
		"versioning.DefaultGapPolicy":                      map[versioning.GapPolicy]string{versioning.Park: "Park", versioning.Apply: "Apply"}[versioning.DefaultGapPolicy],
		"versioning.DefaultLatePolicy":                     map[versioning.LatePolicy]string{versioning.HoldLate: "HoldLate", versioning.ApplyLate: "ApplyLate"}[versioning.DefaultLatePolicy],
		"versioning.DefaultUnversionedPolicy":              map[versioning.UnversionedPolicy]string{versioning.PassUnversioned: "PassUnversioned", versioning.RejectUnversioned: "RejectUnversioned"}[versioning.DefaultUnversionedPolicy],
		"versioning.DefaultParkTimeout":                    human(versioning.DefaultParkTimeout),
		"versioning.DefaultMaxGap":                         fmt.Sprint(versioning.DefaultMaxGap),
		"versioning.DefaultSweepInterval":                  human(versioning.DefaultSweepInterval),
		"versioning.DefaultSweepBatch":                     fmt.Sprint(versioning.DefaultSweepBatch),
		"versioning.DefaultMaxReleaseAttempts":             fmt.Sprint(versioning.DefaultMaxReleaseAttempts),
		"versioning.DefaultReleaseBackoff.Initial":         human(versioning.DefaultReleaseBackoff.Initial),
		"versioning.DefaultReleaseBackoff.Max":             human(versioning.DefaultReleaseBackoff.Max),
		"middleware.MaxUnregisteredEventTypes":             fmt.Sprint(middleware.MaxUnregisteredEventTypes),
		"dedup.DefaultRetention":                           human(dedup.DefaultRetention),
		"eventlinetest.DefaultTrials":                      fmt.Sprint(eventlinetest.DefaultTrials),
		"eventlinetest.DefaultKafkaTrials":                 fmt.Sprint(eventlinetest.DefaultKafkaTrials),
		"kafkatest.DefaultPartitions":                      fmt.Sprint(kafkatest.DefaultPartitions),
		"verify.DefaultMaxPendingAge":                      human(verify.DefaultMaxPendingAge),
		"verify.DefaultMaxParkedAge":                       human(verify.DefaultMaxParkedAge),
	}
	design, err := os.ReadFile("docs/DESIGN.md")
	require.NoError(t, err)
	rows := defaultsTable(t, string(design))
	seen := map[string]bool{}
	for _, r := range rows {
		w, ok := want[r.constant]
		require.True(t, ok, "docs/DESIGN.md, Defaults at a glance: %s is not checked by this test; add it", r.constant)
		require.Equal(t, w, r.value, "docs/DESIGN.md, Defaults at a glance: %s (%s)", r.constant, r.what)
		seen[r.constant] = true
	}
	for c := range want {
		require.True(t, seen[c], "docs/DESIGN.md, Defaults at a glance: no row for %s", c)
	}
}

type defaultRow struct{ what, value, constant string }

// defaultsTable returns the rows of the table under "## Defaults at a
// glance".
func defaultsTable(t *testing.T, doc string) []defaultRow {
	t.Helper()
	_, after, ok := strings.Cut(doc, "\n## Defaults at a glance\n")
	require.True(t, ok, "docs/DESIGN.md has no Defaults at a glance section")
	var rows []defaultRow
	for _, line := range strings.Split(after, "\n") {
		if strings.HasPrefix(line, "## ") {
			break
		}
		if !strings.HasPrefix(line, "|") || strings.HasPrefix(line, "|---") || strings.HasPrefix(line, "| what ") {
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		require.Len(t, cells, 3, "a Defaults row has three cells: %s", line)
		rows = append(rows, defaultRow{
			what:     strings.TrimSpace(cells[0]),
			value:    strings.TrimSpace(cells[1]),
			constant: strings.Trim(strings.TrimSpace(cells[2]), "`"),
		})
	}
	require.NotEmpty(t, rows)
	return rows
}

// human writes a duration the way the docs do: 100 ms, 5 s, 5 min, 24 h,
// 7 days.
func human(d time.Duration) string {
	switch {
	case d == 0:
		return "0"
	case d >= 48*time.Hour && d%(24*time.Hour) == 0:
		return fmt.Sprintf("%d days", d/(24*time.Hour))
	case d%time.Hour == 0:
		return fmt.Sprintf("%d h", d/time.Hour)
	case d%time.Minute == 0:
		return fmt.Sprintf("%d min", d/time.Minute)
	case d%time.Second == 0:
		return fmt.Sprintf("%d s", d/time.Second)
	default:
		return fmt.Sprintf("%d ms", d/time.Millisecond)
	}
}

func bytes(n int) string {
	if n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprint(n)
}
