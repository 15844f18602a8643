package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/eventlinetest"
	"github.com/eventline/eventline/examples/internal/extest"
)

func TestMain(m *testing.M) { extest.VerifyTestMain(m) }

func TestDeadLetter(t *testing.T) {
	cfg := extest.Common(t, "example_dead_letter")
	lines := extest.Parse(t, extest.Run(t, 3*time.Minute, run, cfg))
	dead := extest.Expect(t, lines, "event_type=account.limit_changed aggregate_version=2 attempts=1", "Kafka refused it for good: no retries")
	require.Contains(t, dead["reason"], "too large")
	extest.Expect(t, lines, "parked_versions=3,4 applied_version=1")
	sum := extest.Expect(t, lines, "dead_lettered=1 parked=2 replayed=1 released=2 applied_in_order=true")
	require.Contains(t, sum["reason"], "too large")
	extest.NoConnections(t, cfg.Schema)
}

// TestHandlersUnderFaults checks the three account handlers with
// eventline's test kit: under every fault schedule (a withheld
// account.limit_changed, as in the example, among them), each account's
// state and the order its events were applied in equal applying each
// event once, in order.
func TestHandlersUnderFaults(t *testing.T) {
	ev := func(typ, account string, payload any) eventline.Event {
		return extest.Event(t, typ, "account", account, payload)
	}
	var events []eventline.Event
	for _, a := range []string{poisoned, healthy} {
		events = append(events,
			ev(Opened, a, AccountOpened{Owner: a}),
			ev(LimitChanged, a, LimitChange{LimitCents: 50_000}),
			ev(Deposited, a, Deposit{AmountCents: 10_000}),
			ev(Deposited, a, Deposit{AmountCents: 5_000}),
		)
	}
	l := ledger{accounts: "accounts", journal: "journal"}
	extest.UnderFaults(t, ddl, eventlinetest.Case{
		Handlers: map[string]consumer.HandlerFunc{
			Opened:       eventlinetest.JSON(l.opened),
			LimitChanged: eventlinetest.JSON(l.limitChanged),
			Deposited:    eventlinetest.JSON(l.deposited),
		},
		Events: events,
		State: eventlinetest.Rows(`SELECT 'account', id, balance, limit_cents, version, NULL FROM accounts
			UNION ALL SELECT 'journal', account_id, NULL, NULL, NULL, string_agg(event_type || ' v' || version, ', ' ORDER BY seq) FROM journal GROUP BY account_id
			ORDER BY 1, 2`),
	})
}
