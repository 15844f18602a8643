package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/eventlinetest"
	"github.com/eventline/eventline/examples/internal/extest"
	"github.com/eventline/eventline/examples/internal/setup"
)

func TestMain(m *testing.M) { extest.VerifyTestMain(m) }

func TestDeadLetter(t *testing.T) {
	cfg := config{
		Common: extest.Common(t, "example_dead_letter"),
	}
	lines := extest.Parse(t, extest.Run(t, 3*time.Minute, run, cfg))
	dead := extest.Find(t, lines, "attempts", "reason")
	require.Equal(t, "account.limit_changed", dead["event_type"])
	require.Equal(t, 2, extest.Int(t, dead, "aggregate_version"))
	require.Equal(t, 1, extest.Int(t, dead, "attempts"), "Kafka refused it for good: no retries")
	require.Contains(t, dead["reason"], "too large")
	parked := extest.Find(t, lines, "parked_versions")
	require.Equal(t, "3,4", parked["parked_versions"])
	require.Equal(t, 1, extest.Int(t, parked, "applied_version"))
	sum := extest.Find(t, lines, "dead_lettered", "applied_in_order")
	require.Equal(t, 1, extest.Int(t, sum, "dead_lettered"))
	require.Equal(t, 2, extest.Int(t, sum, "parked"))
	require.Equal(t, 1, extest.Int(t, sum, "replayed"))
	require.Equal(t, 2, extest.Int(t, sum, "released"))
	require.Equal(t, "true", sum["applied_in_order"])
	require.Contains(t, sum["reason"], "too large")
	extest.NoConnections(t, setup.AppName(cfg.Schema))
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
