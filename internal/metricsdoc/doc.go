// Package metricsdoc holds the test that keeps docs/METRICS.md in step with
// the metrics eventline's collectors expose: every metric family, with its
// labels, must be documented there, and nothing else.
package metricsdoc
