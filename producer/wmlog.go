package producer

import (
	"context"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill"
)

// unwrapFailed is the message Watermill's forwarder logs, at error level
// with a stack trace, for an envelope it cannot unwrap. The relay
// dead-letters such rows and logs that itself.
const unwrapFailed = "Could not unwrap a message from an envelope"

// watermillLog adapts the relay's slog.Logger for Watermill: routine router
// chatter goes to debug, and handled unwrap failures are not reported as
// errors.
type watermillLog struct {
	watermill.LoggerAdapter
	slog *slog.Logger
}

func newWatermillLog(l *slog.Logger) watermill.LoggerAdapter {
	return watermillLog{watermill.NewSlogLoggerWithLevelMapping(l, map[slog.Level]slog.Level{
		slog.LevelInfo: slog.LevelDebug,
	}), l}
}

// Trace and Debug return before Watermill builds the fields of a line
// nobody reads: the forwarder and subscriber log several per outbox row.
func (l watermillLog) Trace(msg string, fields watermill.LogFields) {
	if l.slog.Enabled(context.Background(), watermill.LevelTrace) {
		l.LoggerAdapter.Trace(msg, fields)
	}
}

func (l watermillLog) Debug(msg string, fields watermill.LogFields) {
	if l.slog.Enabled(context.Background(), slog.LevelDebug) {
		l.LoggerAdapter.Debug(msg, fields)
	}
}

func (l watermillLog) Error(msg string, err error, fields watermill.LogFields) {
	if msg == unwrapFailed {
		l.Debug(msg, fields.Add(watermill.LogFields{"err": err.Error()}))
		return
	}
	l.LoggerAdapter.Error(msg, err, fields)
}

func (l watermillLog) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return watermillLog{l.LoggerAdapter.With(fields), l.slog}
}
