package producer

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// Defaults for Config and RelayConfig: each is the default of the fields it
// is named after, documented there.
const (
	// DefaultMaxMessageBytes, 1 MiB, is Sarama's own default for
	// Producer.MaxMessageBytes and the Kafka Java producer's
	// max.request.size. The producer and the relay must use the same value,
	// so that nothing enters the outbox that the relay can never send; the
	// brokers' message.max.bytes (or the topic's max.message.bytes) must
	// admit it too (Kafka's default, 1,048,588 bytes, does).
	DefaultMaxMessageBytes = 1024 * 1024
	DefaultBatchSize       = 500
	DefaultPollInterval    = 5 * time.Second
	// DefaultRebalanceInterval makes TakeoverBound 10s.
	DefaultRebalanceInterval = 2 * time.Second
	DefaultMaxAttempts       = 5
	// DefaultBackoffInitial, DefaultBackoffMultiplier and DefaultBackoffMax
	// make the default wait before each retry of a message that failed to
	// publish: 1s, 5s, 25s, about 2m, then 10m for every later attempt. With
	// DefaultMaxAttempts a message is dead-lettered after 1s+5s+25s+125s =
	// 156s of waits.
	DefaultBackoffInitial    = time.Second
	DefaultBackoffMultiplier = 5
	DefaultBackoffMax        = 10 * time.Minute
	DefaultRetentionWindow   = 24 * time.Hour
	DefaultCleanupInterval   = 5 * time.Minute
	DefaultCleanupBatchSize  = 1000
	// DefaultPartitioner is Kafka's own partitioner for keyed records.
	DefaultPartitioner = PartitionerMurmur2
)

// Lease timing, in RebalanceIntervals: PostgreSQL keeps a lease
// leaseTTLIntervals from its renewal, its owner relays for
// leaseValidIntervals after sending it (see the top of relay_lease.go).
const (
	leaseTTLIntervals   = 4
	leaseValidIntervals = 3
)

// maxRelayInterval bounds PollInterval and RebalanceInterval. The lease
// timeouts the relay gives PostgreSQL (tcp_user_timeout,
// idle_session_timeout: TakeoverBound(RebalanceInterval) in milliseconds)
// must fit in PostgreSQL's int, about 24.8 days, and a day between looks
// at an idle shard is already longer than any poll needs.
const maxRelayInterval = 24 * time.Hour

// TakeoverBound is the longest the shards of a relay that vanished (host
// gone, network partition, process frozen) wait for another relay, with
// the given RebalanceInterval: its leases expire leaseTTLIntervals after
// its last renewal, and the others look every interval. A relay that
// stops cleanly releases its shards at once.
func TakeoverBound(rebalanceInterval time.Duration) time.Duration {
	return (leaseTTLIntervals + 1) * rebalanceInterval
}

// Partitioner names how the relay maps a record's key (the aggregate id)
// to a Kafka partition. Every relay of one outbox must use the same one:
// see the README's "Partitioning" section before changing it.
type Partitioner string

const (
	// PartitionerMurmur2 is Kafka's default partitioner for keyed records:
	// (murmur2(key) & 0x7fffffff) % partitions, as in the Java client,
	// Kafka Streams, franz-go and librdkafka's "murmur2_random". Another
	// producer of the same keys (a backfill, a connector, a service in
	// another language) lands each key in the same partition.
	PartitionerMurmur2 Partitioner = "murmur2"
	// PartitionerFNV1a is Sarama's default hash partitioner (FNV-1a), the
	// relay's partitioner before murmur2 became the default. Keep it for
	// an existing deployment until it can switch (see the README).
	PartitionerFNV1a Partitioner = "fnv1a"
	// PartitionerSaramaConfig uses SaramaConfig.Producer.Partitioner as
	// given; it must hash the key consistently.
	PartitionerSaramaConfig Partitioner = "sarama-config"
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// Schema is the PostgreSQL schema holding the outbox. Defaults to
	// "eventline".
	Schema string
	// Brokers are the Kafka bootstrap brokers (host:port). Defaults to the
	// KAFKA_BROKERS environment variable.
	Brokers []string
	// SaramaConfig overrides the Kafka producer configuration. Defaults to
	// an idempotent producer waiting for all in-sync replicas with one
	// request in flight per broker; if given, those three settings are
	// enforced on it, since ordering and no-loss depend on them, and so are
	// Partitioner and MaxMessageBytes.
	SaramaConfig *sarama.Config
	// Partitioner maps aggregate ids to Kafka partitions. Defaults to
	// DefaultPartitioner (murmur2, Kafka's own).
	Partitioner Partitioner
	// MaxMessageBytes is the largest record the relay sends to Kafka
	// (Sarama's Producer.MaxMessageBytes); a larger event is dead-lettered.
	// It must not exceed the topics' max.message.bytes. Defaults to
	// DefaultMaxMessageBytes. At least 1024 and below Sarama's
	// MaxRequestSize, as producer.Config.MaxMessageBytes.
	MaxMessageBytes int
	// ID names this relay in logs and as the owner of its shard leases, so
	// it must be valid UTF-8 without NUL bytes. Defaults to
	// "<hostname>-<pid>".
	ID string

	// BatchSize is the number of outbox rows read and published per
	// transaction. Larger batches amortize the transaction and the Kafka
	// round trip; a crash re-sends at most one batch. Defaults to
	// DefaultBatchSize.
	BatchSize int
	// PollInterval is the longest an idle shard sleeps between looks at its
	// table; inserts wake it sooner via NOTIFY. Between 10ms and 24h.
	// Defaults to DefaultPollInterval.
	PollInterval time.Duration
	// MaxPublishRate caps the events per second this relay publishes, over
	// all its shards. 0 means no cap. Defaults to 0.
	MaxPublishRate float64
	// RebalanceInterval is how often the relay renews its shard leases and
	// re-checks its fair share. It bounds takeovers: the shards of a relay
	// that vanished are taken within TakeoverBound(RebalanceInterval), and
	// a relay that cannot renew (its database connection hangs) stops
	// relaying them before that. Between 10ms and 24h (the lease timeouts
	// given to PostgreSQL must fit its limits). Defaults to
	// DefaultRebalanceInterval.
	RebalanceInterval time.Duration

	// Backoff is the schedule of waits before successive retries of a
	// message that failed to publish. A zero field takes its default:
	// Initial DefaultBackoffInitial, Multiplier DefaultBackoffMultiplier,
	// Max DefaultBackoffMax, no Jitter.
	Backoff eventline.Backoff
	// MaxAttempts is how many failed publishes of one message are allowed
	// before it is moved to the dead-letter table and the shard moves on.
	// Failures that mean Kafka is unreachable never dead-letter and are not
	// attempts: the shard retries until Kafka is back, waiting
	// Backoff.Initial, doubling, at most 5 s. Defaults to
	// DefaultMaxAttempts.
	MaxAttempts int

	// RetentionWindow is how long rows stay in the outbox after every
	// consumer group of their shard has acknowledged them. Defaults to
	// DefaultRetentionWindow.
	RetentionWindow time.Duration
	// CleanupInterval is how often the relay deletes expired rows from the
	// shards it owns; negative disables it. Defaults to
	// DefaultCleanupInterval.
	CleanupInterval time.Duration
	// CleanupBatchSize bounds each delete. Defaults to
	// DefaultCleanupBatchSize.
	CleanupBatchSize int

	// AfterPublish, if set, runs after Kafka acknowledged a batch and before
	// the outbox records it, with the batch's event ids. Returning an error
	// leaves the batch unacknowledged: the shard waits Backoff.Initial and
	// publishes it again. This is the crash window the examples and fault
	// tests exercise; to simulate a crash, cancel the relay's context from
	// the hook and return an error: a relay that is stopping publishes
	// nothing more.
	AfterPublish func(shard int, eventIDs []string) error

	// Logger receives the relay's logs. Defaults to slog.Default().
	Logger *slog.Logger
	// Metrics receives the relay's measurements. Optional.
	Metrics *RelayMetrics

	// TracerProvider, when set, makes the relay record a "send <topic>"
	// span (kind producer) per event, a child of the span PublishTx
	// captured in the row, and write that span's context into the Kafka
	// record's headers (traceparent, tracestate, baggage) so the consumer
	// continues the trace. Kafka's errors are recorded on the span.
	// Defaults to nil: no spans, and no cost beyond a nil check.
	TracerProvider trace.TracerProvider
	// Propagator reads the publishing span from the row's metadata and
	// writes the send span into the record headers. Defaults to
	// OpenTelemetry's global propagator if the application set one
	// (otel.SetTextMapPropagator), else W3C trace context and baggage.
	Propagator propagation.TextMapPropagator
}

func (c RelayConfig) withDefaults() RelayConfig {
	c.Schema = cmp.Or(c.Schema, migrations.DefaultSchema)
	if len(c.Brokers) == 0 {
		c.Brokers = kafkaconf.BrokersFromEnv()
	}
	if c.ID == "" {
		host, _ := os.Hostname()
		c.ID = host + "-" + strconv.Itoa(os.Getpid())
	}
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.RebalanceInterval = cmp.Or(c.RebalanceInterval, DefaultRebalanceInterval)
	c.Partitioner = cmp.Or(c.Partitioner, DefaultPartitioner)
	c.MaxMessageBytes = cmp.Or(c.MaxMessageBytes, DefaultMaxMessageBytes)
	c.Backoff = c.Backoff.Or(eventline.Backoff{Initial: DefaultBackoffInitial, Multiplier: DefaultBackoffMultiplier, Max: DefaultBackoffMax})
	c.MaxAttempts = cmp.Or(c.MaxAttempts, DefaultMaxAttempts)
	c.RetentionWindow = cmp.Or(c.RetentionWindow, DefaultRetentionWindow)
	c.CleanupInterval = cmp.Or(c.CleanupInterval, DefaultCleanupInterval)
	c.CleanupBatchSize = cmp.Or(c.CleanupBatchSize, DefaultCleanupBatchSize)
	c.Logger = cmp.Or(c.Logger, slog.Default())
	return c
}

func (c RelayConfig) validate() error {
	// errors.Join drops the nil errors of the checks that passed.
	errs := []error{
		sqlident.Validate("RelayConfig.Schema", c.Schema),
		kafkaconf.ValidateBrokers("RelayConfig.Brokers", c.Brokers),
	}
	if c.BatchSize < 1 || c.BatchSize > 100_000 {
		errs = append(errs, fmt.Errorf("RelayConfig.BatchSize must be between 1 and 100000, got %d", c.BatchSize))
	}
	// The ID is the shard leases' owner: PostgreSQL must store it.
	errs = append(errs, sqlident.Text("RelayConfig.ID", c.ID))
	if c.PollInterval < 10*time.Millisecond || c.PollInterval > maxRelayInterval {
		errs = append(errs, fmt.Errorf("RelayConfig.PollInterval must be between 10ms and %s, got %s", maxRelayInterval, c.PollInterval))
	}
	if c.MaxPublishRate < 0 || math.IsNaN(c.MaxPublishRate) {
		errs = append(errs, fmt.Errorf("RelayConfig.MaxPublishRate must be a rate, not negative (0 means no cap), got %g", c.MaxPublishRate))
	}
	if c.RebalanceInterval < 10*time.Millisecond || c.RebalanceInterval > maxRelayInterval {
		errs = append(errs, fmt.Errorf("RelayConfig.RebalanceInterval must be between 10ms and %s, got %s", maxRelayInterval, c.RebalanceInterval))
	}
	switch c.Partitioner {
	case PartitionerMurmur2, PartitionerFNV1a:
	case PartitionerSaramaConfig:
		if c.SaramaConfig == nil || c.SaramaConfig.Producer.Partitioner == nil {
			errs = append(errs, errors.New(`RelayConfig.Partitioner is "sarama-config" but RelayConfig.SaramaConfig has no Producer.Partitioner: set one, or use "murmur2"`))
		}
	default:
		errs = append(errs, fmt.Errorf(`RelayConfig.Partitioner must be "murmur2", "fnv1a" or "sarama-config", got %q`, c.Partitioner))
	}
	errs = append(errs, validateMaxMessageBytes("RelayConfig.MaxMessageBytes", c.MaxMessageBytes), c.Backoff.Validate("producer.RelayConfig.Backoff"))
	if c.MaxAttempts < 1 {
		errs = append(errs, fmt.Errorf("RelayConfig.MaxAttempts must be at least 1, got %d", c.MaxAttempts))
	}
	if c.RetentionWindow < 0 {
		errs = append(errs, fmt.Errorf("RelayConfig.RetentionWindow must not be negative, got %s", c.RetentionWindow))
	}
	if c.CleanupBatchSize < 1 {
		errs = append(errs, fmt.Errorf("RelayConfig.CleanupBatchSize must be at least 1, got %d", c.CleanupBatchSize))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	// What Run gives Sarama; refused there, it would look like Kafka being
	// unreachable, retried for ever.
	if err := c.producerConfig().Validate(); err != nil {
		return fmt.Errorf("RelayConfig.SaramaConfig: %w", err)
	}
	return nil
}

// producerConfig returns the Sarama configuration with the settings the
// relay's guarantees depend on enforced.
func (c RelayConfig) producerConfig() *sarama.Config {
	sc := c.SaramaConfig
	if sc == nil {
		sc = kafkaconf.Producer("eventline-relay")
	} else {
		copied := *sc
		sc = &copied
	}
	switch c.Partitioner {
	case PartitionerMurmur2:
		sc.Producer.Partitioner = sarama.NewMurmur2Partitioner
	case PartitionerFNV1a:
		sc.Producer.Partitioner = sarama.NewHashPartitioner
	}
	sc.Producer.MaxMessageBytes = c.MaxMessageBytes
	sc.Producer.Idempotent = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Net.MaxOpenRequests = 1
	if sc.Producer.Retry.Max < 1 {
		sc.Producer.Retry.Max = 1
	}
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	if !sc.Version.IsAtLeast(sarama.V0_11_0_0) {
		sc.Version = kafkaconf.Version
	}
	return sc
}
