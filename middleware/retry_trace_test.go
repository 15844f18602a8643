package middleware_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/tracing/tracingtest"
	"github.com/eventline/eventline/middleware"
)

// TestRetriesAreSpanEvents: every retry the chain schedules (a handler
// failure, a conflict, a wait for the database) is an "eventline.retry"
// event on the span of the message's context, with the attempt that
// failed, the kind, the wait and the error, cut to 1 KiB of valid UTF-8;
// the attempt that succeeds and a permanent failure add none.
func TestRetriesAreSpanEvents(t *testing.T) {
	t.Parallel()
	rec := tracingtest.New(t)
	c := &clock{}
	hostile := errors.New(strings.Repeat("\xffé", 100_000))
	s := &script{errs: []error{errHandler, errConflict, errDBDown, hostile, middleware.Permanent(errors.New("cannot apply"))}}
	ctx, span := rec.Provider.Tracer("t").Start(context.Background(), "process orders")
	err := retrying(t, ctx, middleware.Config{}, c, s.handle)
	require.ErrorContains(t, err, "cannot apply")
	span.End()

	evs := rec.Spans()[0].Events
	require.Len(t, evs, 4, "one event per retry, none for the permanent failure")
	want := []struct{ attempt, kind, wait, err string }{
		{"1", "handler", "0.1", errHandler.Error()},
		{"2", "conflict", "0.1", errConflict.Error()},
		{"3", "infrastructure", "0.25", errDBDown.Error()},
		{"4", "handler", "0.2", ""},
	}
	for i, w := range want {
		require.Equal(t, "eventline.retry", evs[i].Name)
		got := map[string]string{}
		for _, kv := range evs[i].Attributes {
			got[string(kv.Key)] = kv.Value.Emit()
		}
		require.Equal(t, w.attempt, got["eventline.retry.attempt"], "event %d", i)
		require.Equal(t, w.kind, got["eventline.retry.kind"], "event %d", i)
		require.Equal(t, w.wait, got["eventline.retry.wait.seconds"], "event %d", i)
		if w.err != "" {
			require.Equal(t, w.err, got["eventline.retry.error"], "event %d", i)
		} else {
			require.True(t, strings.HasSuffix(got["eventline.retry.error"], "…"), "the hostile error is cut")
		}
		require.LessOrEqual(t, len(got["eventline.retry.error"]), 1024, "event %d", i)
		require.True(t, utf8.ValidString(got["eventline.retry.error"]), "event %d", i)
	}
}
