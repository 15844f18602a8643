package metricsdoc_test

import (
	"bufio"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// constructors are eventline's collector constructors, each registering
// what it creates with reg. Describe needs no database, so the status
// collectors get none.
//
// To add metrics: when they come from a new constructor, add it here; then
// add a row per metric family to docs/METRICS.md (the test names what is
// missing). Metrics added to an existing constructor, such as the
// consumer's stage latencies (eventline_consumer_stage_seconds) in
// middleware.NewMetrics, need only their row.
var constructors = map[string]func(reg prometheus.Registerer) error{
	"middleware.NewMetrics": func(reg prometheus.Registerer) error {
		_, err := middleware.NewMetrics(reg)
		return err
	},
	"producer.NewRelayMetrics": func(reg prometheus.Registerer) error {
		_, err := producer.NewRelayMetrics(reg)
		return err
	},
	"producer.NewStatusCollector": func(reg prometheus.Registerer) error {
		return reg.Register(producer.NewStatusCollector(nil, "eventline"))
	},
	"versioning.NewStatusCollector": func(reg prometheus.Registerer) error {
		c, err := versioning.NewStatusCollector(nil, "eventline")
		if err != nil {
			return err
		}
		return reg.Register(c)
	},
}

// capture is a Registerer that keeps what is registered.
type capture struct{ collectors []prometheus.Collector }

func (c *capture) Register(x prometheus.Collector) error {
	c.collectors = append(c.collectors, x)
	return nil
}

func (c *capture) MustRegister(xs ...prometheus.Collector) {
	c.collectors = append(c.collectors, xs...)
}

func (c *capture) Unregister(prometheus.Collector) bool { return false }

var descRE = regexp.MustCompile(`fqName: "([^"]+)".*variableLabels: \{([^}]*)\}`)

// exposed returns metric name -> sorted labels of every collector.
func exposed(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for name, construct := range constructors {
		var reg capture
		require.NoError(t, construct(&reg), name)
		ch := make(chan *prometheus.Desc, 1024)
		for _, c := range reg.collectors {
			c.Describe(ch)
		}
		close(ch)
		for d := range ch {
			m := descRE.FindStringSubmatch(d.String())
			require.NotNil(t, m, "%s: cannot read %s", name, d)
			var labels []string
			if m[2] != "" {
				labels = strings.Split(m[2], ",")
			}
			sort.Strings(labels)
			_, dup := out[m[1]]
			require.False(t, dup, "%s: metric %s is exposed twice", name, m[1])
			out[m[1]] = labels
		}
	}
	return out
}

// metricCellRE matches table rows whose first cell is a metric name.
var metricCellRE = regexp.MustCompile("^\\| `eventline_[a-z0-9_]+` \\|")

var rowRE = regexp.MustCompile("^\\| `(eventline_[a-z0-9_]+)` \\| (counter|gauge|histogram) \\| ([^|]*) \\| [^|]+ \\|$")

// documented returns metric name -> sorted labels of docs/METRICS.md's
// table rows: | `name` | type | `label`, `label` (or —) | meaning |.
func documented(t *testing.T) map[string][]string {
	t.Helper()
	f, err := os.Open("../../docs/METRICS.md")
	require.NoError(t, err)
	defer f.Close()
	out := map[string][]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		if !metricCellRE.MatchString(line) {
			continue
		}
		m := rowRE.FindStringSubmatch(line)
		require.NotNil(t, m, "docs/METRICS.md: a metric row must read | `name` | counter|gauge|histogram | `label`, ... or — | meaning |: %s", line)
		var labels []string
		for _, l := range strings.Split(m[3], ",") {
			if l = strings.Trim(strings.TrimSpace(l), "`"); l != "" && l != "—" {
				labels = append(labels, l)
			}
		}
		sort.Strings(labels)
		_, dup := out[m[1]]
		require.False(t, dup, "docs/METRICS.md documents %s twice", m[1])
		out[m[1]] = labels
	}
	require.NoError(t, sc.Err())
	return out
}

// TestMetricsDocMatchesTheCollectors fails when a metric is missing from
// docs/METRICS.md, documented but not exposed, or documented with other
// labels.
func TestMetricsDocMatchesTheCollectors(t *testing.T) {
	exp, doc := exposed(t), documented(t)
	var missing, extra, wrong []string
	for name, labels := range exp {
		d, ok := doc[name]
		switch {
		case !ok:
			missing = append(missing, name+"{"+strings.Join(labels, ",")+"}")
		case !slices.Equal(d, labels):
			wrong = append(wrong, name+": exposed {"+strings.Join(labels, ",")+"}, documented {"+strings.Join(d, ",")+"}")
		}
	}
	for name := range doc {
		if _, ok := exp[name]; !ok {
			extra = append(extra, name)
		}
	}
	sort.Strings(missing)
	sort.Strings(extra)
	sort.Strings(wrong)
	assert.Empty(t, missing, "metrics exposed but not in docs/METRICS.md")
	assert.Empty(t, extra, "metrics in docs/METRICS.md that no collector exposes")
	assert.Empty(t, wrong, "labels differ")
}
