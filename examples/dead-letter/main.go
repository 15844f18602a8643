// Command dead-letter follows a poison event through eventline: Kafka
// refuses it for good, so the relay holds it for the operator (held_events,
// kind relay_dead_letter) with the reason; the consumer parks the later
// versions of the same account, because applying them would skip one; an
// operator fixes the cause and replays the dead letter; the replay fills
// the gap and the parked versions are applied, in order.
//
// The poison: an account.limit_changed event carries the signed terms, about
// 1 MB. The producer accepts it (its record is within
// producer.DefaultMaxMessageBytes, the limit the relay's Kafka producer
// shares), but the accounts topic was created with max.message.bytes at
// 256 KiB, a per-topic broker limit no producer can know: the broker
// rejects the record (MESSAGE_TOO_LARGE). The fix raises the topic's limit.
//
//	go run ./examples/dead-letter
//
// Output, ending with:
//
//	dead_lettered=1 reason="rejected: … Message was too large …" parked=2 replayed=1 released=2 applied_in_order=true
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/examples/internal/setup"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

func main() {
	var cfg setup.Common
	setup.Main("dead-letter", "example_dead_letter", &cfg, func(ctx context.Context) error { return run(ctx, cfg, os.Stdout) })
}

// The consumer's tables: each account's state, and a journal of every event
// applied, in the order it was applied.
var ddl = []string{
	`CREATE TABLE accounts (
		id          text   PRIMARY KEY,
		balance     bigint NOT NULL DEFAULT 0,
		limit_cents bigint NOT NULL DEFAULT 0,
		version     bigint NOT NULL)`,
	`CREATE TABLE journal (
		seq        bigserial PRIMARY KEY,
		account_id text      NOT NULL,
		version    bigint    NOT NULL,
		event_type text      NOT NULL)`,
}

// The event types.
const (
	Opened       = "account.opened"
	LimitChanged = "account.limit_changed"
	Deposited    = "account.deposited"
)

// AccountOpened is the payload of account.opened.
type AccountOpened struct {
	Owner string `json:"owner"`
}

// LimitChange is the payload of account.limit_changed.
type LimitChange struct {
	LimitCents int64 `json:"limit_cents"`
	// Terms is the signed agreement behind the change.
	Terms string `json:"terms,omitempty"`
}

// Deposit is the payload of account.deposited.
type Deposit struct {
	AmountCents int64 `json:"amount_cents"`
}

const (
	poisoned = "acc-42" // the account whose second event cannot be published
	healthy  = "acc-7"  // an account that is not affected

	// The accounts topic's max.message.bytes, and the value the fix sets.
	topicLimit, fixedTopicLimit = 256 << 10, 2 << 20
	// The poison's Kafka record size: within what the producer and the
	// relay's Kafka producer accept, and so large that the relay's Kafka
	// producer sends it in a request of its own (the broker refuses a whole
	// request, not a record).
	poisonBytes = producer.DefaultMaxMessageBytes - 100
)

func run(ctx context.Context, cfg setup.Common, stdout io.Writer) (err error) {
	// Kafka, and a fresh schema with eventline's tables and the consumer's.
	const shards = 1
	env, err := setup.Start(ctx, cfg, 3, shards, ddl...)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, env.Close(ctx)) }()
	k, db, log := env.Kafka, env.DB, env.Log
	// Names unique to the run (accounts-3fa2c1), so runs against a shared
	// cluster never mix. The accounts topic admits records up to 256 KiB.
	group := k.Group("ledger")
	accountsTopic := k.Topic("accounts")
	if err := k.CreateTopicsWithConfig(ctx, 2, map[string]string{"max.message.bytes": fmt.Sprint(topicLimit)}, accountsTopic); err != nil {
		return err
	}

	relayDB, err := env.Pool(ctx, shards+3)
	if err != nil {
		return err
	}
	consumerDB, err := env.Pool(ctx, 3)
	if err != nil {
		return err
	}

	// 1. Four events for acc-42 and two for acc-7. The producer numbers
	// each account's versions: 1, 2, 3, 4.
	p, err := producer.New(ctx, db, producer.Config{Schema: cfg.Schema, DefaultTopic: accountsTopic})
	if err != nil {
		return err
	}
	var events []eventline.Event
	add := func(eventType, account string, payload any) error {
		e, err := eventline.NewJSONEvent(eventType, "account", account, payload)
		events = append(events, e)
		return err
	}
	poison, err := limitChangeOfSize(poisonBytes)
	if err != nil {
		return err
	}
	err = errors.Join(
		add(Opened, poisoned, AccountOpened{Owner: "Ada"}),
		add(LimitChanged, poisoned, poison), // the poison
		add(Deposited, poisoned, Deposit{AmountCents: 12_000}),
		add(Deposited, poisoned, Deposit{AmountCents: 3_000}),
		add(Opened, healthy, AccountOpened{Owner: "Grace"}),
		add(Deposited, healthy, Deposit{AmountCents: 7_000}),
	)
	if err != nil {
		return err
	}
	if err := p.Publish(ctx, db, events...); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "published=%d poisoned_account=%s poison_type=%s poison_record_bytes=%d topic_max_message_bytes=%d\n",
		len(events), poisoned, LimitChanged, poisonBytes, topicLimit)

	// 2. The relay. Kafka refusing a record for good (too large) is
	// dead-lettered at once; a message that keeps failing otherwise would
	// be tried twice (short retries, so the example takes seconds). Either
	// way the shard moves on to the events behind it.
	relay, err := producer.NewRelay(ctx, relayDB, producer.RelayConfig{
		Schema:      cfg.Schema,
		Brokers:     k.Brokers,
		Backoff:     eventline.Backoff{Initial: 200 * time.Millisecond, Max: 200 * time.Millisecond, Multiplier: 1},
		MaxAttempts: 2,
		Logger:      log,
	})
	if err != nil {
		return err
	}
	// 3. The consumer. Park is the default gap policy; it is spelled out
	// here because this example is about it.
	reg := prometheus.NewRegistry()
	metrics, err := middleware.NewMetrics(reg)
	if err != nil {
		return err
	}
	c, err := consumer.New(consumerDB, consumer.Config{
		Config: middleware.Config{
			Group:     group,
			Schema:    cfg.Schema,
			GapPolicy: versioning.Park,
			Logger:    log,
			Metrics:   metrics,
		},
		Brokers: k.Brokers,
		Topics:  []string{accountsTopic},
	})
	if err != nil {
		return err
	}
	if err := registerHandlers(c, cfg.Schema); err != nil {
		return err
	}

	bg := setup.NewBackground(ctx)
	defer func() { err = errors.Join(err, bg.Stop()) }()
	bg.Go(relay.Run)
	bg.Go(c.Run)

	// 4. The relay gives up on the poison: it is held for the operator
	// (held_events, kind relay_dead_letter) with the reason, and the shard
	// goes on.
	var dls []admin.HeldEvent
	err = setup.WaitFor(ctx, time.Minute, "the poison event to be dead-lettered", func() (bool, error) {
		var err error
		dls, err = admin.ListHeld(ctx, db, cfg.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter})
		return len(dls) > 0, err
	})
	if err != nil {
		return err
	}
	dead := dls[0]
	fmt.Fprintf(stdout, "dead_letter id=%d event_type=%s aggregate_id=%s aggregate_version=%d topic=%s attempts=%d reason=%q\n",
		dead.ID, dead.EventType, dead.AggregateID, dead.AggregateVersion, dead.Topic, dead.Attempts, dead.Reason)

	// 5. The consumer applies acc-42 version 1, and parks versions 3 and 4:
	// applying them now would skip version 2. acc-7 is not held up.
	// The consumer's tables say so: its parked events and the version it
	// applied per aggregate.
	var parked []string
	var unaffected int64
	err = setup.WaitFor(ctx, time.Minute, "versions 3 and 4 to be parked and acc-7 to be applied", func() (bool, error) {
		var err error
		if parked, err = parkedVersions(ctx, db, cfg.Schema, group, poisoned); err != nil {
			return false, err
		}
		unaffected, err = appliedVersion(ctx, db, cfg.Schema, group, healthy)
		return len(parked) == 2 && unaffected == 2, err
	})
	if err != nil {
		return err
	}
	current, err := appliedVersion(ctx, db, cfg.Schema, group, poisoned)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "consumer account=%s applied_version=%d parked=%d parked_versions=%s unaffected_account=%s unaffected_version=%d\n",
		poisoned, current, len(parked), strings.Join(parked, ","), healthy, unaffected)

	// 6. The fix: raise the topic's max.message.bytes. Then replay the
	// dead letter: it goes back into the outbox with the same event id and
	// version, and the relay publishes it like a new event.
	if err := k.SetTopicConfig(accountsTopic, "max.message.bytes", fmt.Sprint(fixedTopicLimit)); err != nil {
		return err
	}
	res, err := admin.ReplayHeld(ctx, db, cfg.Schema, admin.HeldFilter{IDs: []int64{dead.ID}})
	if err != nil {
		return err
	}
	replayed := len(res.Enqueued)
	fmt.Fprintf(stdout, "fix topic_max_message_bytes=%d replayed=%d\n", fixedTopicLimit, replayed)

	// 7. Version 2 arrives, is applied, and releases 3 and 4 in the same
	// transaction.
	journal := pgx.Identifier{cfg.Schema, "journal"}.Sanitize()
	var applied []int64
	err = setup.WaitFor(ctx, time.Minute, "acc-42 to reach version 4", func() (bool, error) {
		rows, err := db.Query(ctx, `SELECT version FROM `+journal+` WHERE account_id = $1 ORDER BY seq`, poisoned)
		if err != nil {
			return false, err
		}
		applied, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		return len(applied) >= 4, err
	})
	if err != nil {
		return err
	}
	if err := bg.Stop(); err != nil {
		return err
	}

	// 8. Check the outcome in the database.
	inOrder := slices.Equal(applied, []int64{1, 2, 3, 4})
	var parkedLeft int64
	if err := db.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{cfg.Schema, "parked_events"}.Sanitize()+` WHERE consumer_group = $1`, group).
		Scan(&parkedLeft); err != nil {
		return err
	}
	st, err := admin.ReadOutboxStatus(ctx, db, cfg.Schema)
	if err != nil {
		return err
	}
	var balance, limit int64
	if err := db.QueryRow(ctx, `SELECT balance, limit_cents FROM `+pgx.Identifier{cfg.Schema, "accounts"}.Sanitize()+` WHERE id = $1`, poisoned).
		Scan(&balance, &limit); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "applied account=%s versions=%s balance=%d limit=%d parked_left=%d dead_letters_waiting=%d\n",
		poisoned, joinInts(applied), balance, limit, parkedLeft, st.DeadLetters)
	released := int(setup.Counter(reg, "eventline_consumer_parked_released_total", nil))
	fmt.Fprintf(stdout, "dead_lettered=%d reason=%q parked=%d replayed=%d released=%d applied_in_order=%t\n",
		len(dls), dead.Reason, len(parked), replayed, released, inOrder)
	switch {
	case !inOrder:
		return fmt.Errorf("acc-42's versions were applied in order %v, want [1 2 3 4]", applied)
	case released != len(parked):
		return fmt.Errorf("%d parked events released, want %d", released, len(parked))
	case parkedLeft != 0 || st.DeadLetters != 0 || st.Backlog() != 0:
		return fmt.Errorf("left over: %d parked, %d dead letters, %d in the outbox", parkedLeft, st.DeadLetters, st.Backlog())
	case balance != 15_000 || limit != 50_000:
		return fmt.Errorf("acc-42 has balance %d and limit %d, want 15000 and 50000", balance, limit)
	}
	return nil
}

// limitChangeOfSize returns the poison's payload, its terms padded so that
// the event's Kafka record is size bytes (producer.EncodedRecordSize, what
// Sarama counts).
func limitChangeOfSize(size int) (LimitChange, error) {
	lc := LimitChange{LimitCents: 50_000}
	draft, err := eventline.NewJSONEvent(LimitChanged, "account", poisoned, lc)
	if err != nil {
		return lc, err
	}
	draft.ID, draft.AggregateVersion = eventline.NewEventID(), 2
	msg, err := eventline.Encode(draft)
	if err != nil {
		return lc, err
	}
	pad := size - producer.EncodedRecordSize(msg) - len(`,"terms":""`)
	if pad < 0 {
		return lc, fmt.Errorf("a limit change's record is already %d bytes, over %d", producer.EncodedRecordSize(msg), size)
	}
	lc.Terms = strings.Repeat("x", pad)
	return lc, nil
}

// registerHandlers registers one handler per event type, writing to the
// schema's tables.
// parkedVersions lists the versions of an account the group has parked,
// from its parked_events table.
func parkedVersions(ctx context.Context, db *pgxpool.Pool, schema, group, account string) ([]string, error) {
	rows, err := db.Query(ctx, `SELECT aggregate_version::text FROM `+pgx.Identifier{schema, "parked_events"}.Sanitize()+`
		WHERE consumer_group = $1 AND aggregate_type = 'account' AND aggregate_id = $2 ORDER BY aggregate_version`, group, account)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// appliedVersion is the last version of an account the group applied,
// from its aggregate_versions table (0 before the first).
func appliedVersion(ctx context.Context, db *pgxpool.Pool, schema, group, account string) (int64, error) {
	var v int64
	err := db.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM `+pgx.Identifier{schema, "aggregate_versions"}.Sanitize()+`
		WHERE consumer_group = $1 AND aggregate_type = 'account' AND aggregate_id = $2`, group, account).Scan(&v)
	return v, err
}

func registerHandlers(c *consumer.Consumer, schema string) error {
	l := ledger{accounts: pgx.Identifier{schema, "accounts"}.Sanitize(), journal: pgx.Identifier{schema, "journal"}.Sanitize()}
	return errors.Join(
		consumer.HandleJSON(c, Opened, l.opened),
		consumer.HandleJSON(c, LimitChanged, l.limitChanged),
		consumer.HandleJSON(c, Deposited, l.deposited),
	)
}

// ledger holds the handlers. Each writes through tx, the consumer
// transaction, so its effect commits together with the version advance.
// accounts and journal are the tables' SQL names.
type ledger struct{ accounts, journal string }

func (l ledger) opened(ctx context.Context, tx pgx.Tx, e eventline.Event, _ AccountOpened) error {
	if _, err := tx.Exec(ctx, `INSERT INTO `+l.accounts+` (id, version) VALUES ($1, $2)`, e.AggregateID, e.AggregateVersion); err != nil {
		return err
	}
	return l.record(ctx, tx, e)
}

func (l ledger) limitChanged(ctx context.Context, tx pgx.Tx, e eventline.Event, c LimitChange) error {
	if _, err := tx.Exec(ctx, `UPDATE `+l.accounts+` SET limit_cents = $2, version = $3 WHERE id = $1`, e.AggregateID, c.LimitCents, e.AggregateVersion); err != nil {
		return err
	}
	return l.record(ctx, tx, e)
}

func (l ledger) deposited(ctx context.Context, tx pgx.Tx, e eventline.Event, d Deposit) error {
	if _, err := tx.Exec(ctx, `UPDATE `+l.accounts+` SET balance = balance + $2, version = $3 WHERE id = $1`, e.AggregateID, d.AmountCents, e.AggregateVersion); err != nil {
		return err
	}
	return l.record(ctx, tx, e)
}

func (l ledger) record(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
	_, err := tx.Exec(ctx, `INSERT INTO `+l.journal+` (account_id, version, event_type) VALUES ($1, $2, $3)`, e.AggregateID, e.AggregateVersion, e.Type)
	return err
}

func joinInts(vs []int64) string {
	s := make([]string, len(vs))
	for i, v := range vs {
		s[i] = fmt.Sprint(v)
	}
	return strings.Join(s, ",")
}
