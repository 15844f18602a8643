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

func TestCrashWindow(t *testing.T) {
	cfg := config{
		Common: extest.Common(t, "example_crash_window"),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	err := run(ctx, cfg, &out)
	t.Logf("output:\n%s", out.String())
	require.NoError(t, err)

	lines := extest.Parse(t, out.String())
	require.NotEmpty(t, extest.Find(t, lines, "message_id")["message_id"])
	first := extest.Find(t, lines, "simulated_crash")
	require.Equal(t, "true", first["simulated_crash"])
	require.Equal(t, 1, extest.Int(t, first, "published"))
	require.Equal(t, 0, extest.Int(t, first, "outbox_acked"))
	crash := extest.Find(t, lines, "published_after_crash")
	require.Equal(t, 1, extest.Int(t, crash, "published_after_crash"))
	require.Equal(t, 1, extest.Int(t, crash, "outbox_pending"))
	retry := extest.Find(t, lines, "published_after_retry")
	require.Equal(t, 2, extest.Int(t, retry, "published_after_retry"))
	require.Equal(t, 0, extest.Int(t, retry, "outbox_pending"))
	consumed := extest.Find(t, lines, "applied")
	require.Equal(t, 2, extest.Int(t, consumed, "delivered"))
	require.Equal(t, 1, extest.Int(t, consumed, "applied"))
	require.Equal(t, 1, extest.Int(t, consumed, "duplicates_skipped"))
	extest.NoConnections(t, setup.AppName(cfg.Schema))
}
