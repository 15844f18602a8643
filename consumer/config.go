package consumer

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/versioning"
)

// Defaults for [Config].
const (
	// DefaultMaxRetries is how many times a failing event is retried
	// before it is dead-lettered.
	DefaultMaxRetries = middleware.DefaultMaxRetries
	// DefaultRetryInitialInterval is the wait before the first retry.
	DefaultRetryInitialInterval = middleware.DefaultRetryInitialInterval
	// DefaultRetryMaxInterval caps the wait between retries.
	DefaultRetryMaxInterval = middleware.DefaultRetryMaxInterval
	// DefaultRetryMultiplier scales the wait after each retry.
	DefaultRetryMultiplier = middleware.DefaultRetryMultiplier
	// DefaultRetryJitter spreads each retry's wait by up to ±20%.
	DefaultRetryJitter = 0.2
	// DefaultInfraRetryInitialInterval is the first wait while the
	// database is unavailable.
	DefaultInfraRetryInitialInterval = middleware.DefaultInfraInitialInterval
	// DefaultInfraRetryMaxInterval caps the waits while the database is
	// unavailable.
	DefaultInfraRetryMaxInterval = middleware.DefaultInfraMaxInterval
	// DefaultTxTimeout bounds one event's transaction.
	DefaultTxTimeout = middleware.DefaultTxTimeout
	// DefaultShutdownTimeout bounds how long Run waits for in-flight
	// events when its context ends.
	DefaultShutdownTimeout = 30 * time.Second
	// NoRetries, as Config.MaxRetries, dead-letters a failing event after
	// its first attempt.
	NoRetries = -1
	// NoJitter, as Config.RetryJitter, waits exactly the schedule's
	// intervals.
	NoJitter = -1.0
	// NoTxTimeout, as Config.TxTimeout, leaves event transactions
	// unbounded.
	NoTxTimeout = middleware.NoTxTimeout
)

// Config configures a Consumer. Only Group and Topics are required.
type Config struct {
	// Brokers are the Kafka brokers, host:port. Defaults to the
	// comma-separated list in the KAFKA_BROKERS environment variable.
	Brokers []string
	// Group is the Kafka consumer group, and the group eventline keeps
	// dedup records, versions and parked events under. Consumers sharing a
	// group share the work (and the exactly-once bookkeeping). Required;
	// it is stored with every record, so it must be valid UTF-8 without
	// NUL bytes.
	Group string
	// Topics are the Kafka topics to consume; each gets one Watermill
	// handler named "eventline/<group>/<topic>". Required.
	Topics []string
	// Schema is the PostgreSQL schema holding eventline's tables. Defaults
	// to "eventline".
	Schema string
	// GapPolicy is what happens to an event that arrives ahead of a missing
	// version of its aggregate. Defaults to versioning.Park.
	GapPolicy versioning.GapPolicy
	// PolicyByType overrides GapPolicy per event type.
	PolicyByType map[string]versioning.GapPolicy
	// LatePolicy is what happens to a late event, one whose version was
	// given up on (the park timeout passed) before it arrived: held for
	// the operator (`eventline held list -kind late`), or applied at once with
	// middleware.IsLate. Defaults to versioning.HoldLate.
	LatePolicy versioning.LatePolicy
	// LatePolicyByType overrides LatePolicy per event type.
	LatePolicyByType map[string]versioning.LatePolicy
	// MaxGap bounds the versions one event may leave missing in front of
	// it; an event beyond it (an inflated version) is dead-lettered. An
	// event that declares its predecessor (aggregate_previous_version,
	// written by the producer for sparse versions) is not bounded: it
	// waits for that one event. Defaults to versioning.DefaultMaxGap
	// (1000).
	MaxGap int64
	// MaxReleaseAttempts is how many failed attempts to apply a parked
	// event are allowed before it is given up (held as late in held_events, its
	// version recorded as skipped). Defaults to
	// versioning.DefaultMaxReleaseAttempts (10).
	MaxReleaseAttempts int
	// Unversioned is what happens to an event without an aggregate
	// version. Defaults to versioning.PassUnversioned.
	Unversioned versioning.UnversionedPolicy
	// ParkTimeout is how long an aggregate's parked events wait for the
	// missing versions before the sweeper skips the gap. Defaults to
	// versioning.DefaultParkTimeout (1 hour).
	ParkTimeout time.Duration
	// SweepInterval is the pause between sweeper passes. Defaults to
	// versioning.DefaultSweepInterval (5s).
	SweepInterval time.Duration
	// MaxRetries is how many times a failing event is retried (each
	// attempt in a new transaction) before it is dead-lettered. Permanent
	// errors are not retried; database outages and transaction conflicts
	// are retried without spending it (see middleware.Retry). Defaults to
	// DefaultMaxRetries (5); NoRetries disables retries.
	MaxRetries int
	// RetryInitialInterval is the wait before the first retry; retry n
	// waits min(RetryInitialInterval × RetryMultiplier^(n−1),
	// RetryMaxInterval), so the defaults wait 100ms, 200ms, 400ms, 800ms,
	// 1.6s. Defaults to DefaultRetryInitialInterval (100ms).
	RetryInitialInterval time.Duration
	// RetryMaxInterval caps the wait between retries. Defaults to
	// DefaultRetryMaxInterval (10s), or RetryInitialInterval when that is
	// longer.
	RetryMaxInterval time.Duration
	// RetryMultiplier scales the wait after each retry. Defaults to
	// DefaultRetryMultiplier (2).
	RetryMultiplier float64
	// RetryJitter spreads each wait at random by up to this fraction of
	// it, between 0 and 1. Defaults to DefaultRetryJitter (0.2); NoJitter
	// waits exactly the schedule's intervals.
	RetryJitter float64
	// InfraRetryInitialInterval is the first wait while the database is
	// unavailable (refused, reset, restarting, not answering within
	// TxTimeout); waits double up to InfraRetryMaxInterval and go on for
	// as long as the outage lasts. Defaults to
	// DefaultInfraRetryInitialInterval (250ms).
	InfraRetryInitialInterval time.Duration
	// InfraRetryMaxInterval caps those waits: once the database answers
	// again, the consumer resumes within it. Defaults to
	// DefaultInfraRetryMaxInterval (5s).
	InfraRetryMaxInterval time.Duration
	// TxTimeout bounds one event's transaction (BEGIN, the handler,
	// COMMIT); it is how a database connection that stops answering
	// without closing is noticed (see middleware.Config.TxTimeout).
	// Defaults to DefaultTxTimeout (1m); NoTxTimeout disables it.
	TxTimeout time.Duration
	// SaramaConfig is the Kafka consumer's Sarama configuration. Defaults
	// to a configuration that starts a new group at the oldest offset
	// (Consumer.Offsets.Initial = sarama.OffsetOldest) and auto-commits
	// marked offsets every second. When you pass your own, keep
	// OffsetOldest, or a new group skips events published before it
	// started. New checks it with Sarama's Validate.
	SaramaConfig *sarama.Config
	// Lanes is how many lanes each Kafka partition is split into: events
	// are spread over lanes by aggregate, each aggregate's events stay in
	// one lane in offset order, and lanes run concurrently, so a slow
	// handler is bound by the number of lanes rather than by the number of
	// partitions. Give the pool at least partitions × Lanes connections
	// for the lanes to run in parallel. 1 handles a partition's events one
	// at a time. Defaults to DefaultLanes (8); at most MaxLanes.
	Lanes int
	// BatchSize is the most events of one lane applied in one PostgreSQL
	// transaction (dedup records and version checks for the whole batch in
	// one round trip with BEGIN, the handlers one after the other, one
	// COMMIT, then the offsets). Per-event guarantees are unchanged; an
	// event that fails costs only itself (see middleware.Batch). 1
	// disables batching. Lanes and BatchSize both 1 use watermill-kafka's
	// subscriber, as eventline did before batches. Defaults to
	// DefaultBatchSize (16); at most MaxBatchSize.
	BatchSize int
	// BatchLinger is how long a free lane waits for more events before it
	// applies a batch that is not full. Defaults to DefaultBatchLinger (0:
	// a batch is what queued up while the lane was busy, so an idle
	// consumer applies each event at once). At most MaxBatchLinger.
	BatchLinger time.Duration
	// ShutdownTimeout bounds how long Run waits, after its context ends,
	// for in-flight events to finish; events still running then are rolled
	// back (and redelivered later). Defaults to DefaultShutdownTimeout
	// (30s).
	ShutdownTimeout time.Duration
	// Upcasters, when set, rewrites each event's payload to the current
	// schema version of its type just before its handler runs (also for
	// events released from parking), so handlers registered with Handle
	// and HandleJSON only ever see the current version. An event it cannot
	// upcast is dead-lettered as permanent. Defaults to none: handlers get
	// payloads as written.
	Upcasters *eventline.Upcasters
	// Middleware runs around every event, outside the eventline
	// transaction and inside retries and dead-lettering (tracing,
	// logging…). The first is outermost. The events of one batch pass it
	// concurrently, each returning once the batch has committed.
	Middleware []message.HandlerMiddleware
	// Logger receives what the consumer, Watermill and the sweeper report
	// (Watermill's info lines at debug level). Defaults to slog.Default().
	Logger *slog.Logger
	// Metrics, when set, counts what happens to events (see
	// middleware.NewMetrics).
	Metrics *middleware.Metrics
	// TracerProvider, when set, traces every event: a "process <topic>"
	// span (kind consumer) per delivery continuing the trace the relay
	// wrote into the record's headers, with eventline.outcome; "release
	// <topic>" spans for parked events applied later, linked to their
	// original trace; "dead_letter <topic>" spans. Handlers find the span
	// in their context, so their own spans nest under it. Defaults to nil:
	// no spans, and no cost beyond a nil check per event.
	TracerProvider trace.TracerProvider
	// Propagator reads the trace context from record headers. Defaults to
	// OpenTelemetry's global propagator if the application set one
	// (otel.SetTextMapPropagator), else W3C trace context and baggage.
	Propagator propagation.TextMapPropagator
	// MeterProvider, when set, receives the stage latencies (also in
	// eventline_consumer_stage_seconds) as the OTel histogram
	// eventline.stage.duration. Defaults to nil.
	MeterProvider metric.MeterProvider
}

func (c Config) withDefaults() Config {
	if len(c.Brokers) == 0 {
		c.Brokers = kafkaconf.BrokersFromEnv()
	}
	if c.Schema == "" {
		c.Schema = migrations.DefaultSchema
	}
	switch c.MaxRetries {
	case 0:
		c.MaxRetries = DefaultMaxRetries
	case NoRetries:
		c.MaxRetries = 0
	}
	if c.RetryInitialInterval == 0 {
		c.RetryInitialInterval = DefaultRetryInitialInterval
	}
	if c.RetryMaxInterval == 0 {
		c.RetryMaxInterval = max(DefaultRetryMaxInterval, c.RetryInitialInterval)
	}
	if c.RetryMultiplier == 0 {
		c.RetryMultiplier = DefaultRetryMultiplier
	}
	switch c.RetryJitter {
	case 0:
		c.RetryJitter = DefaultRetryJitter
	case NoJitter:
		c.RetryJitter = 0
	}
	if c.InfraRetryInitialInterval == 0 {
		c.InfraRetryInitialInterval = DefaultInfraRetryInitialInterval
	}
	if c.InfraRetryMaxInterval == 0 {
		c.InfraRetryMaxInterval = max(DefaultInfraRetryMaxInterval, c.InfraRetryInitialInterval)
	}
	if c.TxTimeout == 0 {
		c.TxTimeout = DefaultTxTimeout
	}
	if c.SaramaConfig == nil {
		c.SaramaConfig = kafkaconf.Consumer("eventline-" + c.Group)
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.Lanes == 0 {
		c.Lanes = DefaultLanes
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c Config) validate() error {
	if err := kafkaconf.ValidateBrokers("consumer.Config.Brokers", c.Brokers); err != nil {
		return err
	}
	if strings.TrimSpace(c.Group) == "" {
		return errors.New("consumer.Config.Group is empty: name the Kafka consumer group")
	}
	if err := sqlident.Text("consumer.Config.Group", c.Group); err != nil {
		return err
	}
	if len(c.Topics) == 0 {
		return errors.New("consumer.Config.Topics is empty: name at least one topic to consume")
	}
	seen := map[string]bool{}
	for _, t := range c.Topics {
		if err := eventline.ValidateTopic(t); err != nil {
			return fmt.Errorf("consumer.Config.Topics: %w", err)
		}
		if seen[t] {
			return fmt.Errorf("consumer.Config.Topics lists %q twice", t)
		}
		seen[t] = true
	}
	if err := sqlident.Validate("consumer.Config.Schema", c.Schema); err != nil {
		return err
	}
	switch {
	case c.MaxRetries < 0:
		return fmt.Errorf("consumer.Config.MaxRetries is %d; use a positive count, 0 for %d, or NoRetries", c.MaxRetries, DefaultMaxRetries)
	case c.RetryInitialInterval < 0:
		return fmt.Errorf("consumer.Config.RetryInitialInterval is %s; it must be positive", c.RetryInitialInterval)
	case c.RetryMaxInterval < c.RetryInitialInterval:
		return fmt.Errorf("consumer.Config.RetryMaxInterval (%s) is below RetryInitialInterval (%s)", c.RetryMaxInterval, c.RetryInitialInterval)
	case c.RetryMultiplier < 1 || math.IsNaN(c.RetryMultiplier) || math.IsInf(c.RetryMultiplier, 0):
		return fmt.Errorf("consumer.Config.RetryMultiplier is %g; it must be at least 1", c.RetryMultiplier)
	case c.RetryJitter < 0 || c.RetryJitter > 1 || math.IsNaN(c.RetryJitter):
		return fmt.Errorf("consumer.Config.RetryJitter is %g; it must be between 0 and 1 (or NoJitter)", c.RetryJitter)
	case c.InfraRetryInitialInterval < 0:
		return fmt.Errorf("consumer.Config.InfraRetryInitialInterval is %s; it must be positive", c.InfraRetryInitialInterval)
	case c.InfraRetryMaxInterval < c.InfraRetryInitialInterval:
		return fmt.Errorf("consumer.Config.InfraRetryMaxInterval (%s) is below InfraRetryInitialInterval (%s)", c.InfraRetryMaxInterval, c.InfraRetryInitialInterval)
	case c.TxTimeout < 0 && c.TxTimeout != NoTxTimeout:
		return fmt.Errorf("consumer.Config.TxTimeout is %s; it must be positive (or NoTxTimeout)", c.TxTimeout)
	case c.ShutdownTimeout < 0:
		return fmt.Errorf("consumer.Config.ShutdownTimeout is %s; it must be positive", c.ShutdownTimeout)
	}
	if err := validateLanes("consumer.Config", c.Lanes, c.BatchSize, c.BatchLinger, c.ShutdownTimeout, "ShutdownTimeout"); err != nil {
		return err
	}
	if err := c.SaramaConfig.Validate(); err != nil {
		// Run's Kafka subscriber would refuse it.
		return fmt.Errorf("consumer.Config.SaramaConfig: %w", err)
	}
	for i, m := range c.Middleware {
		if m == nil {
			return fmt.Errorf("consumer.Config.Middleware[%d] is nil", i)
		}
	}
	return nil
}
