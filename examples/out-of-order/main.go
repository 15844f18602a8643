// Command out-of-order shows the consumer's version gate restoring each
// aggregate's order. Versions 1..k of several bank accounts are written to
// Kafka shuffled and partly duplicated, the way a pipeline with retries,
// replays and several producers can deliver them. The consumer applies each
// version once, in version order: events that arrive early are parked and
// released when their predecessor arrives, duplicates are skipped by the
// dedup record, and late copies of old versions are discarded as stale.
//
//	go run ./examples/out-of-order [-accounts 20] [-versions 5] [-seed 1]
//
// The last line compares the balances in the consumer's table with the
// balances computed by applying every account's changes in version order
// (interest makes the order matter), and the program exits with status 1
// if they differ or any version was applied twice or out of order:
//
//	delivered=… applied=100 duplicates_skipped=… stale_discarded=10 parked=… released=… final_state_matches=true
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/examples/internal/setup"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/versioning"
)

type config struct {
	setup.Common
	// Accounts is the number of aggregates, Versions the events of each.
	Accounts, Versions int
	// DuplicateEvery sends every n-th event twice (0: none).
	DuplicateEvery int
	// StaleReplays is how many old versions are sent again at the end
	// under new event ids.
	StaleReplays int
	// Seed seeds the shuffle and the amounts; 0 picks one at random.
	Seed uint64
}

func main() {
	var cfg config
	flag.IntVar(&cfg.Accounts, "accounts", 20, "number of accounts (aggregates)")
	flag.IntVar(&cfg.Versions, "versions", 5, "events per account (versions 1..n)")
	flag.IntVar(&cfg.DuplicateEvery, "duplicate-every", 3, "deliver every n-th event twice (0: none)")
	flag.IntVar(&cfg.StaleReplays, "stale-replays", 10, "old versions sent again at the end under new event ids")
	flag.Uint64Var(&cfg.Seed, "seed", 0, "random seed for amounts and shuffling (0: random)")
	setup.Main("out-of-order", "example_out_of_order", &cfg.Common, func(ctx context.Context) error { return run(ctx, cfg, os.Stdout) })
}

// The consumer's tables: the balance of each account, and a journal of
// every change applied, in the order it was applied.
var ddl = []string{
	`CREATE TABLE accounts (
		id      text   PRIMARY KEY,
		balance bigint NOT NULL,
		version bigint NOT NULL)`,
	`CREATE TABLE journal (
		seq        bigserial PRIMARY KEY,
		account_id text      NOT NULL,
		version    bigint    NOT NULL,
		event_id   text      NOT NULL)`,
}

// AccountChanged is the payload of account.changed events: a deposit, or
// interest on the current balance. Interest makes the order matter.
type AccountChanged struct {
	Deposit     int64 `json:"deposit,omitempty"`
	InterestPct int64 `json:"interest_pct,omitempty"`
}

// Apply returns the balance after the change. The consumer's SQL does the
// same arithmetic (bigint division truncates like Go's).
func (c AccountChanged) Apply(balance int64) int64 {
	return balance + c.Deposit + balance*c.InterestPct/100
}

const eventType = "account.changed"

func run(ctx context.Context, cfg config, stdout io.Writer) (err error) {
	if cfg.Accounts <= 0 || cfg.Versions <= 0 || cfg.DuplicateEvery < 0 || cfg.StaleReplays < 0 {
		return errors.New("-accounts and -versions must be positive, -duplicate-every and -stale-replays not negative")
	}
	if cfg.Seed == 0 {
		cfg.Seed = rand.Uint64()
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0))

	// Kafka, and a fresh schema with eventline's tables (one outbox shard:
	// nothing is published through it here) and the consumer's.
	env, err := setup.Start(ctx, cfg.Common, 4, 1, ddl...)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, env.Close(ctx)) }()
	k, db, log := env.Kafka, env.DB, env.Log
	// Names unique to the run (ledger-3fa2c1), so runs against a shared
	// cluster never mix.
	group, topic := k.Group("ledger"), k.Topic("accounts")
	if err := k.CreateTopics(ctx, 4, topic); err != nil {
		return err
	}

	// 1. Every account's history, versions 1..n, in order.
	history := map[string][]eventline.Event{}
	var ids []string
	for a := range cfg.Accounts {
		id := fmt.Sprintf("acc-%03d", a+1)
		ids = append(ids, id)
		for v := 1; v <= cfg.Versions; v++ {
			change := AccountChanged{Deposit: 100 * (1 + rng.Int64N(50))}
			if v > 1 && rng.IntN(3) == 0 {
				change = AccountChanged{InterestPct: 1 + rng.Int64N(10)}
			}
			e, err := eventline.NewJSONEvent(eventType, "account", id, change)
			if err != nil {
				return err
			}
			e.ID, e.AggregateVersion = eventline.NewEventID(), int64(v)
			history[id] = append(history[id], e)
		}
	}

	// 2. What the consumer receives: every event, every n-th one twice,
	// all shuffled.
	var deliveries []eventline.Event
	n := 0
	for _, id := range ids {
		for _, e := range history[id] {
			deliveries = append(deliveries, e)
			if n++; cfg.DuplicateEvery > 0 && n%cfg.DuplicateEvery == 0 {
				deliveries = append(deliveries, e)
			}
		}
	}
	rng.Shuffle(len(deliveries), func(i, j int) { deliveries[i], deliveries[j] = deliveries[j], deliveries[i] })
	events := cfg.Accounts * cfg.Versions
	fmt.Fprintf(stdout, "seed=%d accounts=%d versions=%d events=%d deliveries=%d topic=%s\n", cfg.Seed, cfg.Accounts, cfg.Versions, events, len(deliveries), topic)
	fmt.Fprintf(stdout, "delivery_order account=%s versions=%s\n", ids[0], versionsOf(deliveries, ids[0]))
	if err := setup.PublishEvents(k.Brokers, topic, deliveries); err != nil {
		return err
	}

	// 3. The consumer: the Park policy holds early versions back until
	// their predecessors are applied.
	consumerDB, err := env.Pool(ctx, 4)
	if err != nil {
		return err
	}
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
		Topics:  []string{topic},
	})
	if err != nil {
		return err
	}
	accounts, journal := pgx.Identifier{cfg.Schema, "accounts"}.Sanitize(), pgx.Identifier{cfg.Schema, "journal"}.Sanitize()
	if err := consumer.HandleJSON(c, eventType, applyChange(accounts, journal)); err != nil {
		return err
	}
	bg := setup.NewBackground(ctx)
	defer func() { err = errors.Join(err, bg.Stop()) }()
	bg.Go(c.Run)

	count := func(name string) int { return int(setup.Counter(reg, name, nil)) }
	handled := func() int {
		// Every delivery ends in exactly one of these.
		return count("eventline_consumer_events_applied_total") + count("eventline_consumer_events_duplicate_total") +
			count("eventline_consumer_events_stale_total") + count("eventline_consumer_events_parked_total")
	}
	if err := setup.WaitFor(ctx, 2*time.Minute, "the consumer to handle every delivery", func() (bool, error) {
		return handled() >= len(deliveries), nil
	}); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "after_shuffle delivered=%d applied_on_arrival=%d parked=%d released=%d duplicates_skipped=%d stale_discarded=%d\n",
		handled(), count("eventline_consumer_events_applied_total"), count("eventline_consumer_events_parked_total"),
		count("eventline_consumer_parked_released_total"), count("eventline_consumer_events_duplicate_total"), count("eventline_consumer_events_stale_total"))

	// 4. Late copies of old versions under new event ids: what a producer
	// that re-creates events on retry sends, or a redelivery whose dedup
	// record has expired. Dedup does not know them; the version gate
	// discards them because the account is already past their version.
	var replays []eventline.Event
	for range cfg.StaleReplays {
		id := ids[rng.IntN(len(ids))]
		e := history[id][rng.IntN(len(history[id]))]
		e.ID = eventline.NewEventID()
		replays = append(replays, e)
	}
	if err := setup.PublishEvents(k.Brokers, topic, replays); err != nil {
		return err
	}
	delivered := len(deliveries) + len(replays)
	if err := setup.WaitFor(ctx, time.Minute, "the consumer to handle the late copies", func() (bool, error) {
		return handled() >= delivered, nil
	}); err != nil {
		return err
	}
	if err := bg.Stop(); err != nil {
		return err
	}

	// 5. Check the consumer's tables against in-order application.
	if err := checkJournal(ctx, db, journal, ids, cfg.Versions); err != nil {
		return err
	}
	mismatches, err := compareBalances(ctx, db, accounts, history)
	if err != nil {
		return err
	}
	var parkedLeft int64
	if err := db.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{cfg.Schema, "parked_events"}.Sanitize()+` WHERE consumer_group = $1`, group).
		Scan(&parkedLeft); err != nil {
		return err
	}
	var applied int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM `+journal).Scan(&applied); err != nil {
		return err
	}
	parked, released := count("eventline_consumer_events_parked_total"), count("eventline_consumer_parked_released_total")
	duplicates, stale := count("eventline_consumer_events_duplicate_total"), count("eventline_consumer_events_stale_total")
	fmt.Fprintf(stdout, "delivered=%d applied=%d duplicates_skipped=%d stale_discarded=%d parked=%d released=%d parked_left=%d final_state_matches=%t\n",
		delivered, applied, duplicates, stale, parked, released, parkedLeft, len(mismatches) == 0)

	switch {
	case len(mismatches) > 0:
		return fmt.Errorf("balances differ from in-order application: %s", strings.Join(mismatches, "; "))
	case applied != events:
		return fmt.Errorf("%d changes applied, want %d (each version once)", applied, events)
	case parked != released || parkedLeft != 0:
		return fmt.Errorf("%d events parked but %d released (%d still parked)", parked, released, parkedLeft)
	case stale != len(replays):
		return fmt.Errorf("%d events discarded as stale, want the %d late copies", stale, len(replays))
	case handled() != delivered:
		return fmt.Errorf("the consumer handled %d deliveries, want %d", handled(), delivered)
	}
	return nil
}

// applyChange is the consumer's handler: it updates the account's balance
// and appends to the journal (the tables' SQL names), through tx, the
// consumer transaction.
func applyChange(accounts, journal string) func(ctx context.Context, tx pgx.Tx, e eventline.Event, ch AccountChanged) error {
	return func(ctx context.Context, tx pgx.Tx, e eventline.Event, ch AccountChanged) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+accounts+` AS a (id, balance, version) VALUES ($1, $2, $4)
			ON CONFLICT (id) DO UPDATE SET balance = a.balance + $2 + a.balance * $3 / 100, version = $4`,
			e.AggregateID, ch.Deposit, ch.InterestPct, e.AggregateVersion)
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `INSERT INTO `+journal+` (account_id, version, event_id) VALUES ($1, $2, $3)`, e.AggregateID, e.AggregateVersion, e.ID)
		return err
	}
}

// checkJournal checks that every account's versions were applied once
// each, in order 1..n.
func checkJournal(ctx context.Context, db *pgxpool.Pool, journal string, ids []string, versions int) error {
	rows, err := db.Query(ctx, `SELECT account_id, array_agg(version ORDER BY seq) FROM `+journal+` GROUP BY account_id`)
	if err != nil {
		return err
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
		ID       string
		Versions []int64
	}])
	if err != nil {
		return err
	}
	want := make([]int64, versions)
	for i := range want {
		want[i] = int64(i + 1)
	}
	if len(got) != len(ids) {
		return fmt.Errorf("the journal has changes for %d accounts, want %d", len(got), len(ids))
	}
	for _, g := range got {
		if !slices.Equal(g.Versions, want) {
			return fmt.Errorf("account %s: versions applied in order %v, want %v", g.ID, g.Versions, want)
		}
	}
	return nil
}

// compareBalances compares each account's balance with the balance its
// history gives when applied in version order.
func compareBalances(ctx context.Context, db *pgxpool.Pool, accounts string, history map[string][]eventline.Event) ([]string, error) {
	var mismatches []string
	for id, events := range history {
		var want int64
		for _, e := range events {
			ch, err := eventline.DecodePayload[AccountChanged](e)
			if err != nil {
				return nil, err
			}
			want = ch.Apply(want)
		}
		var got int64
		if err := db.QueryRow(ctx, `SELECT balance FROM `+accounts+` WHERE id = $1`, id).Scan(&got); err != nil {
			return nil, fmt.Errorf("account %s: %w", id, err)
		}
		if got != want {
			mismatches = append(mismatches, fmt.Sprintf("%s: balance %d, in order %d", id, got, want))
		}
	}
	slices.Sort(mismatches)
	return mismatches, nil
}

// versionsOf lists the versions of one account in delivery order.
func versionsOf(deliveries []eventline.Event, id string) string {
	var vs []string
	for _, e := range deliveries {
		if e.AggregateID == id {
			vs = append(vs, fmt.Sprint(e.AggregateVersion))
		}
	}
	return strings.Join(vs, ",")
}
