package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/eventlinetest"
	"github.com/eventline/eventline/examples/internal/extest"
)

func TestMain(m *testing.M) { extest.VerifyTestMain(m) }

func TestOutOfOrder(t *testing.T) {
	cfg := config{
		Common:         extest.Common(t, "example_out_of_order"),
		Accounts:       6,
		Versions:       5,
		DuplicateEvery: 2,
		StaleReplays:   4,
	}
	lines := extest.Parse(t, extest.Run(t, 3*time.Minute, run, cfg))
	res := extest.Expect(t, lines, "final_state_matches=true applied=30 duplicates_skipped=15 stale_discarded=4 parked_left=0")
	require.Equal(t, 30+15+4, extest.Int(t, res, "delivered"), "30 events, 15 second copies, 4 late copies")
	require.Equal(t, extest.Int(t, res, "parked"), extest.Int(t, res, "released"))
	extest.NoConnections(t, cfg.Schema)
}

// TestHandlerUnderFaults checks the ledger handler with eventline's test
// kit: under every fault schedule, each account's balance and its journal
// (versions in the order they were applied) equal applying each change
// once, in version order.
func TestHandlerUnderFaults(t *testing.T) {
	var events []eventline.Event
	for v := int64(1); v <= 4; v++ {
		for a := int64(1); a <= 3; a++ {
			change := AccountChanged{Deposit: 100 * (a + v)}
			if v%2 == 0 {
				change = AccountChanged{InterestPct: a + v}
			}
			events = append(events, extest.Event(t, eventType, "account", fmt.Sprintf("acc-%d", a), change))
		}
	}
	extest.UnderFaults(t, ddl, eventlinetest.Case{
		Handlers: map[string]consumer.HandlerFunc{eventType: eventlinetest.JSON(applyChange("accounts", "journal"))},
		Events:   events,
		State: eventlinetest.Rows(`SELECT 'balance', id, balance::text FROM accounts
			UNION ALL SELECT 'applied', account_id, string_agg(version::text, ',' ORDER BY seq) FROM journal GROUP BY account_id
			ORDER BY 1, 2`),
	})
}
