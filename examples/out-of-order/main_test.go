package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/examples/internal/extest"
	"github.com/eventline/eventline/examples/internal/setup"
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
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	err := run(ctx, cfg, &out)
	t.Logf("output:\n%s", out.String())
	require.NoError(t, err)

	lines := extest.Parse(t, out.String())
	res := extest.Find(t, lines, "final_state_matches")
	require.Equal(t, "true", res["final_state_matches"])
	require.Equal(t, 30+15+4, extest.Int(t, res, "delivered"), "30 events, 15 second copies, 4 late copies")
	require.Equal(t, 30, extest.Int(t, res, "applied"))
	require.Equal(t, 15, extest.Int(t, res, "duplicates_skipped"))
	require.Equal(t, 4, extest.Int(t, res, "stale_discarded"))
	require.Equal(t, extest.Int(t, res, "parked"), extest.Int(t, res, "released"))
	require.Equal(t, 0, extest.Int(t, res, "parked_left"))
	extest.NoConnections(t, setup.AppName(cfg.Schema))
}
