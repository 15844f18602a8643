package metricsdoc_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"unsafe"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
)

// unusedPool never connects: describing a collector queries nothing, but
// the status collectors' constructors refuse a nil handle.
var unusedPool = func() *pgxpool.Pool {
	pool, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/unused")
	if err != nil {
		panic(err)
	}
	return pool
}()

// constructors are eventline's collector constructors, each registering
// what it creates with reg. Describe needs no database, so the status
// collectors get a pool that never connects.
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
	"admin.NewStatusCollector": func(reg prometheus.Registerer) error {
		c, err := admin.NewStatusCollector(unusedPool, "eventline")
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

// metricsDoc is the file checked.
const metricsDoc = "../../docs/METRICS.md"

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

// documented returns metric name -> sorted labels, and metric name ->
// type, of docs/METRICS.md's table rows:
// | `name` | type | `label`, `label` (or —) | meaning |.
func documented(t *testing.T, path string) (labelsOf map[string][]string, typeOf map[string]string) {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	out, types := map[string][]string{}, map[string]string{}
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
		types[m[1]] = m[2]
	}
	require.NoError(t, sc.Err())
	return out, types
}

// TestMetricsDocMatchesTheCollectors fails when a metric is missing from
// docs/METRICS.md, documented but not exposed, or documented with other
// labels.
func TestMetricsDocMatchesTheCollectors(t *testing.T) {
	exp := exposed(t)
	doc, _ := documented(t, metricsDoc)
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

// statusEnv is a migrated schema where the status collectors report every
// series they have: a consumer group, and a committed outbox row held back
// by an older open transaction (the horizon holder gauges). release ends
// that transaction.
func statusEnv(t *testing.T) (env pgtest.Env, release func()) {
	t.Helper()
	ctx := context.Background()
	env = pgtest.New(t, pgtest.Options{Shards: 1, MaxConns: 6})
	_, err := env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "aggregate_versions")+
		` (consumer_group, aggregate_type, aggregate_id, version) VALUES ('g', 'order', 'a', 1)`)
	require.NoError(t, err)
	holder, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = holder.Exec(ctx, `SELECT pg_current_xact_id()`)
	require.NoError(t, err)
	p, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: "orders"})
	require.NoError(t, err)
	e, err := eventline.NewJSONEvent("order.created", "order", "a", map[string]int{})
	require.NoError(t, err)
	require.NoError(t, p.Publish(ctx, env.Pool, e))
	release = func() { _ = holder.Rollback(context.Background()) }
	t.Cleanup(release)
	return env, release
}

// gatheredTypes returns metric name -> counter, gauge or histogram, as the
// collectors report them. Each collector's label vectors (found through
// its fields, however deep) get one child, so that every family is
// collected; the status collectors read env.
func gatheredTypes(t *testing.T, env pgtest.Env) map[string]string {
	t.Helper()
	out := map[string]string{}
	for name, construct := range constructors {
		var reg capture
		require.NoError(t, constructWith(construct, name, env, &reg), name)
		for _, c := range reg.collectors {
			touchVectors(t, reflect.ValueOf(&c).Elem(), map[uintptr]bool{})
			ch := make(chan prometheus.Metric, 4096)
			c.Collect(ch)
			close(ch)
			for m := range ch {
				d := descRE.FindStringSubmatch(m.Desc().String())
				require.NotNil(t, d, "%s: cannot read %s", name, m.Desc())
				var pb dto.Metric
				require.NoError(t, m.Write(&pb), "%s: %s", name, d[1])
				typ := ""
				switch {
				case pb.Counter != nil:
					typ = "counter"
				case pb.Gauge != nil:
					typ = "gauge"
				case pb.Histogram != nil:
					typ = "histogram"
				case pb.Summary != nil:
					typ = "summary"
				default:
					typ = "untyped"
				}
				if prev, ok := out[d[1]]; ok && prev != typ {
					t.Errorf("%s: %s is collected as %s and %s", name, d[1], prev, typ)
				}
				out[d[1]] = typ
			}
		}
	}
	return out
}

// constructWith runs construct; the status collectors get env's pool and
// schema instead of none.
func constructWith(construct func(prometheus.Registerer) error, name string, env pgtest.Env, reg prometheus.Registerer) error {
	switch name {
	case "admin.NewStatusCollector":
		c, err := admin.NewStatusCollector(env.Pool, env.Schema)
		if err != nil {
			return err
		}
		return reg.Register(c)
	}
	return construct(reg)
}

// touchVectors walks v (addressable) through pointers, interfaces,
// structs, slices, arrays and maps of eventline's own types, and gives
// every label vector it finds one child with placeholder label values.
func touchVectors(t *testing.T, v reflect.Value, seen map[uintptr]bool) {
	if !v.CanInterface() {
		if !v.CanAddr() {
			return
		}
		v = reflect.NewAt(v.Type(), unsafe.Pointer(v.UnsafeAddr())).Elem()
	}
	switch v.Kind() {
	case reflect.Interface:
		if !v.IsNil() {
			e := reflect.New(v.Elem().Type()).Elem()
			e.Set(v.Elem())
			touchVectors(t, e, seen)
		}
	case reflect.Pointer:
		if v.IsNil() || seen[v.Pointer()] {
			return
		}
		seen[v.Pointer()] = true
		if touchVector(t, v.Interface()) {
			return
		}
		if strings.HasPrefix(v.Type().Elem().PkgPath(), "github.com/eventline/") {
			touchVectors(t, v.Elem(), seen)
		}
	case reflect.Struct:
		if !strings.HasPrefix(v.Type().PkgPath(), "github.com/eventline/") {
			return
		}
		for i := range v.NumField() {
			touchVectors(t, v.Field(i), seen)
		}
	case reflect.Slice, reflect.Array:
		for i := range v.Len() {
			touchVectors(t, v.Index(i), seen)
		}
	case reflect.Map:
		for it := v.MapRange(); it.Next(); {
			e := reflect.New(it.Value().Type()).Elem()
			e.Set(it.Value())
			touchVectors(t, e, seen)
		}
	}
}

// touchVector gives x one child when it is a label vector.
func touchVector(t *testing.T, x any) bool {
	labels := func(c prometheus.Collector) []string {
		ch := make(chan *prometheus.Desc, 1)
		c.Describe(ch)
		d := descRE.FindStringSubmatch((<-ch).String())
		require.NotNil(t, d)
		n := 0
		if d[2] != "" {
			n = len(strings.Split(d[2], ","))
		}
		vals := make([]string, n)
		for i := range vals {
			vals[i] = fmt.Sprint("v", i)
		}
		return vals
	}
	switch vec := x.(type) {
	case *prometheus.CounterVec:
		vec.WithLabelValues(labels(vec)...)
	case *prometheus.GaugeVec:
		vec.WithLabelValues(labels(vec)...)
	case *prometheus.HistogramVec:
		vec.WithLabelValues(labels(vec)...)
	case *prometheus.SummaryVec:
		vec.WithLabelValues(labels(vec)...)
	default:
		return false
	}
	return true
}

// typeMismatches lists the metrics documented with another type than the
// collectors report, and those whose type could not be gathered.
func typeMismatches(exposed map[string][]string, gathered, doc map[string]string) []string {
	var out []string
	for name := range exposed {
		got, ok := gathered[name]
		switch {
		case !ok:
			out = append(out, name+": no series collected, its type is unknown")
		case doc[name] != "" && doc[name] != got:
			out = append(out, name+": "+got+", documented as "+doc[name])
		}
	}
	sort.Strings(out)
	return out
}

// TestMetricsDocTypesMatchTheCollectors fails when docs/METRICS.md gives a
// metric another type (counter, gauge, histogram) than its collector
// reports; and, on a copy of it with one type changed, that it would.
func TestMetricsDocTypesMatchTheCollectors(t *testing.T) {
	env, release := statusEnv(t)
	gathered := gatheredTypes(t, env)
	release()
	exp := exposed(t)
	_, doc := documented(t, metricsDoc)
	require.Empty(t, typeMismatches(exp, gathered, doc), "types differ between docs/METRICS.md and the collectors")

	b, err := os.ReadFile(metricsDoc)
	require.NoError(t, err)
	for _, c := range []struct{ row, wrong string }{
		{"| `eventline_relay_forwarded_total` | counter |", "| `eventline_relay_forwarded_total` | gauge |"},
		{"| `eventline_group_parked_events` | gauge |", "| `eventline_group_parked_events` | counter |"},
		{"| `eventline_outbox_horizon_holder_pid` | gauge |", "| `eventline_outbox_horizon_holder_pid` | histogram |"},
	} {
		require.Contains(t, string(b), c.row)
		wrong := filepath.Join(t.TempDir(), "METRICS.md")
		require.NoError(t, os.WriteFile(wrong, []byte(strings.Replace(string(b), c.row, c.wrong, 1)), 0o644))
		_, doc := documented(t, wrong)
		require.Len(t, typeMismatches(exp, gathered, doc), 1, "a wrong type is caught: %s", c.wrong)
	}
}
