package verify

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/IBM/sarama"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/versioning"
)

// Defaults for [Config].
const (
	// DefaultMaxPendingAge is how long an event may stay committed and not
	// applied by a group before it counts as stuck (a problem) rather than
	// pending (information). With its defaults the relay gives up on an
	// event it cannot publish after about 2.6 minutes (5 attempts,
	// waiting 1s, 5s, 25s and 125s: producer.DefaultMaxAttempts and
	// producer.DefaultBackoff*) and dead-letters it, so an event still
	// pending after 5 minutes is not a publish retry in progress: no relay
	// runs or it cannot reach Kafka (it waits that out without
	// dead-lettering), or the group's consumer is down or behind.
	DefaultMaxPendingAge = 5 * time.Minute
	// DefaultMaxParkedAge is how long an event may stay parked before it
	// counts as a problem: 30 minutes more than the consumer's default
	// park timeout (versioning.DefaultParkTimeout, 1 hour), after which
	// the sweeper skips the gap and applies what is parked. An event
	// parked for longer means no sweeper runs or its release keeps
	// failing. An event parked for less is waiting for its missing
	// versions as designed (information). Raise it above a consumer's
	// configured ParkTimeout, if that is longer.
	DefaultMaxParkedAge = versioning.DefaultParkTimeout + 30*time.Minute
	// DefaultDedupRetention is the dedup records' retention assumed when
	// none is given: dedup.DefaultRetention, what `eventline cleanup` uses.
	DefaultDedupRetention = dedup.DefaultRetention
	// DefaultMaxDetails is how many findings of one kind are listed per
	// consumer group (the oldest ones); the rest are only counted.
	DefaultMaxDetails = 20
	// NoDetails, as Config.MaxDetails, lists no finding, only counts.
	NoDetails = -1
	// DefaultChunkSize is how many outbox events are looked up at once in a
	// separate consumer database.
	DefaultChunkSize = 5000
)

const (
	// clockSkew is the allowance for clock differences between the
	// producer's database, the consumer's database and the Kafka brokers
	// when verify compares their timestamps.
	clockSkew = time.Minute
	// kafkaIdleTimeout is how long a partition may deliver nothing before
	// verify stops reading it short of the high watermark it took at the
	// start (only transaction markers, which carry no event, can leave
	// such a hole at the end of a partition).
	kafkaIdleTimeout = 10 * time.Second
)

// Config says what Run checks. The zero value checks every consumer group
// found in the default schema against all retained data, without Kafka.
type Config struct {
	// Schema is the PostgreSQL schema holding the outbox, the relay's
	// dead letters and, unless ConsumerSchema says otherwise, the
	// consumer tables. Defaults to "eventline".
	Schema string
	// ConsumerSchema is the schema holding processed_events,
	// aggregate_versions, parked_events and skipped_versions in the
	// consumer database. Defaults to Schema.
	ConsumerSchema string
	// Since and Until bound the window: events are selected by the time
	// their outbox row was written, dead letters and late events by
	// held_at, parked events by parked_at, skipped gaps by skipped_at and
	// applied events (for the order check) by processed_at. Zero means
	// unbounded.
	Since, Until time.Time
	// Groups limits the check to these consumer groups. Defaults to every
	// group found in processed_events and aggregate_versions.
	Groups []string
	// GroupTopics names the Kafka topics each group consumes. A group not
	// listed gets the topics its Kafka consumer group (of the same name)
	// has committed offsets for, or else the topics of the events it has
	// dedup records of. Only events of a group's topics are expected to be
	// applied by it.
	GroupTopics map[string][]string
	// EffectsQueries holds, per group, a SELECT over the group's own
	// effects returning one row per applied effect: the event id, and
	// optionally a second column that increases with the time the effect
	// was written (a bigserial id, a timestamp). An event id on more than
	// one row was applied twice; with the second column, versions of one
	// aggregate that do not increase are out of order. The query runs in a
	// read-only transaction on the consumer database.
	EffectsQueries map[string]string
	// Brokers are the Kafka brokers. Empty: Kafka is not read, and events
	// that were relayed are not traced further than the relay.
	Brokers []string
	// SaramaConfig is the Kafka client configuration. Defaults to one with
	// eventline's protocol version and client id "eventline-verify".
	SaramaConfig *sarama.Config
	// MaxPendingAge: see DefaultMaxPendingAge.
	MaxPendingAge time.Duration
	// MaxParkedAge: see DefaultMaxParkedAge.
	MaxParkedAge time.Duration
	// DedupRetention is the retention `eventline cleanup` runs with for
	// dedup records. An event committed before now minus DedupRetention
	// whose dedup record is missing is unverifiable, not lost: cleanup may
	// have deleted the record. Defaults to DefaultDedupRetention.
	DedupRetention time.Duration
	// MaxDetails: see DefaultMaxDetails. NoDetails lists none: findings
	// are only counted.
	MaxDetails int
	// ChunkSize: see DefaultChunkSize.
	ChunkSize int
	// Logger receives warnings about what could not be read in full.
	// Defaults to slog.Default().
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	c.Schema = cmp.Or(c.Schema, migrations.DefaultSchema)
	c.ConsumerSchema = cmp.Or(c.ConsumerSchema, c.Schema)
	c.MaxPendingAge = cmp.Or(c.MaxPendingAge, DefaultMaxPendingAge)
	c.MaxParkedAge = cmp.Or(c.MaxParkedAge, DefaultMaxParkedAge)
	c.DedupRetention = cmp.Or(c.DedupRetention, DefaultDedupRetention)
	c.MaxDetails = cmp.Or(c.MaxDetails, DefaultMaxDetails)
	c.ChunkSize = cmp.Or(c.ChunkSize, DefaultChunkSize)
	c.Logger = cmp.Or(c.Logger, slog.Default())
	if len(c.Brokers) > 0 && c.SaramaConfig == nil {
		c.SaramaConfig = kafkaconf.Consumer("eventline-verify")
	}
	return c
}

func (c Config) validate() error {
	if err := sqlident.Validate("verify.Config.Schema", c.Schema); err != nil {
		return err
	}
	if err := sqlident.Validate("verify.Config.ConsumerSchema", c.ConsumerSchema); err != nil {
		return err
	}
	if !c.Since.IsZero() && !c.Until.IsZero() && !c.Since.Before(c.Until) {
		return fmt.Errorf("verify.Config: Since (%s) must be before Until (%s)", c.Since.Format(time.RFC3339), c.Until.Format(time.RFC3339))
	}
	for name, d := range map[string]time.Duration{
		"MaxPendingAge": c.MaxPendingAge, "MaxParkedAge": c.MaxParkedAge, "DedupRetention": c.DedupRetention,
	} {
		if d < 0 {
			return fmt.Errorf("verify.Config.%s is %s; it must be positive (0 means the default)", name, d)
		}
	}
	if c.MaxDetails < NoDetails || c.ChunkSize < 0 {
		return fmt.Errorf("verify.Config: MaxDetails (%d) and ChunkSize (%d) must be positive (0 means the default; MaxDetails may be NoDetails)", c.MaxDetails, c.ChunkSize)
	}
	if slices.Contains(c.Groups, "") {
		return errors.New("verify.Config.Groups has an empty name")
	}
	for g, topics := range c.GroupTopics {
		if g == "" || len(topics) == 0 {
			return fmt.Errorf("verify.Config.GroupTopics: group %q needs a name and at least one topic", g)
		}
		for _, t := range topics {
			if err := eventline.ValidateTopic(t); err != nil {
				return fmt.Errorf("verify.Config.GroupTopics[%q]: %w", g, err)
			}
		}
	}
	for g, q := range c.EffectsQueries {
		if g == "" || trimQuery(q) == "" {
			return fmt.Errorf("verify.Config.EffectsQueries: group %q needs a name and a SELECT", g)
		}
	}
	if len(c.Brokers) > 0 {
		if err := kafkaconf.ValidateBrokers("verify.Config.Brokers", c.Brokers); err != nil {
			return err
		}
	}
	return nil
}

// trimQuery drops whitespace and trailing semicolons, so a query can be
// wrapped as a subquery.
func trimQuery(q string) string {
	return strings.TrimRight(strings.TrimSpace(q), "; \t\n")
}

// windowSQL returns a condition on col (a timestamptz expression) using
// the parameters $1 (since) and $2 (until).
func windowSQL(col string) string {
	return "($1::timestamptz IS NULL OR " + col + " >= $1) AND ($2::timestamptz IS NULL OR " + col + " < $2)"
}
