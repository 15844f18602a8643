// Package metricsdoc holds the test that keeps docs/METRICS.md in step with
// the metrics eventline's collectors expose: every metric family, with its
// labels and its type (counter, gauge, histogram, as the collectors report
// it when gathered), must be documented there, and nothing else. The type
// check reads the status collectors from a PostgreSQL schema (internal/pgtest)
// prepared so that they report every series.
package metricsdoc
