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

func TestOrders(t *testing.T) {
	cfg := config{
		Common:         extest.Common(t, "example_orders"),
		Orders:         120,
		RedeliverEvery: 4,
		Writers:        3,
		Progress:       500 * time.Millisecond,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	err := run(ctx, cfg, &out)
	t.Logf("output:\n%s", out.String())
	require.NoError(t, err)

	lines := extest.Parse(t, out.String())
	require.Equal(t, "progress", lines[1].Tag)
	sum := extest.Find(t, lines, "orders", "forwarded", "billing_applied", "shipping_applied", "duplicates_skipped")
	require.Equal(t, 120, extest.Int(t, sum, "orders"))
	require.Equal(t, 120, extest.Int(t, sum, "forwarded"))
	require.Equal(t, 120, extest.Int(t, sum, "billing_applied"))
	require.Equal(t, 120, extest.Int(t, sum, "shipping_applied"))
	require.Equal(t, 30, extest.Int(t, sum, "republished"))
	require.Equal(t, 60, extest.Int(t, sum, "redelivered"))
	require.Equal(t, 60, extest.Int(t, sum, "duplicates_skipped"), "each republished record is skipped once per group")
	extest.NoConnections(t, setup.AppName(cfg.Schema))
}
