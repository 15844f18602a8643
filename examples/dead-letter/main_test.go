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

func TestDeadLetter(t *testing.T) {
	cfg := config{
		Common: extest.Common(t, "example_dead_letter"),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	err := run(ctx, cfg, &out)
	t.Logf("output:\n%s", out.String())
	require.NoError(t, err)

	lines := extest.Parse(t, out.String())
	dead := extest.Find(t, lines, "attempts", "reason")
	require.Equal(t, "account.limit_changed", dead["event_type"])
	require.Equal(t, 2, extest.Int(t, dead, "aggregate_version"))
	require.Equal(t, 2, extest.Int(t, dead, "attempts"))
	require.Contains(t, dead["reason"], "gave up after 2 attempts")
	parked := extest.Find(t, lines, "parked_versions")
	require.Equal(t, "3,4", parked["parked_versions"])
	require.Equal(t, 1, extest.Int(t, parked, "applied_version"))
	sum := extest.Find(t, lines, "dead_lettered", "applied_in_order")
	require.Equal(t, 1, extest.Int(t, sum, "dead_lettered"))
	require.Equal(t, 2, extest.Int(t, sum, "parked"))
	require.Equal(t, 1, extest.Int(t, sum, "replayed"))
	require.Equal(t, 2, extest.Int(t, sum, "released"))
	require.Equal(t, "true", sum["applied_in_order"])
	require.Contains(t, sum["reason"], "does not exist")
	extest.NoConnections(t, setup.AppName(cfg.Schema))
}
