package wmlog

import (
	"bytes"
	"errors"
	"log/slog"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"
)

func TestLogger(t *testing.T) {
	logAt := func(level slog.Level) (watermill.LoggerAdapter, *bytes.Buffer) {
		var buf bytes.Buffer
		return New(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: level}))), &buf
	}

	l, buf := logAt(slog.LevelInfo)
	l.Trace("trace line", watermill.LogFields{"k": 1})
	l.Debug("debug line", nil)
	l.Info("routine line", nil)
	require.Empty(t, buf.String(), "router chatter (info) goes to debug, below the logger's level")
	l.Error(unwrapFailed, errors.New("bad envelope"), nil)
	require.Empty(t, buf.String(), "an unwrap failure the relay handles is not an error")
	l.With(watermill.LogFields{"shard": 3}).Error("real failure", errors.New("boom"), nil)
	require.Contains(t, buf.String(), "level=ERROR msg=\"real failure\" shard=3 error=boom")

	l, buf = logAt(watermill.LevelTrace)
	l.Trace("trace line", watermill.LogFields{"k": 1})
	l.Info("routine line", nil)
	l.Error(unwrapFailed, errors.New("bad envelope"), nil)
	require.Contains(t, buf.String(), "msg=\"trace line\" k=1")
	require.Contains(t, buf.String(), "level=DEBUG msg=\"routine line\"")
	require.Contains(t, buf.String(), "level=DEBUG msg=\""+unwrapFailed+"\" err=\"bad envelope\"")
}
