// Package wmlog adapts a slog.Logger for Watermill's routers, subscribers
// and forwarders, for the relay and the consumer alike.
package wmlog

import (
	"context"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill"
)

// unwrapFailed is the message Watermill's forwarder logs, at error level
// with a stack trace, for an envelope it cannot unwrap. The relay
// dead-letters such rows and logs that itself.
const unwrapFailed = "Could not unwrap a message from an envelope"

// logger adapts a slog.Logger for Watermill: routine router chatter goes
// to debug, and handled unwrap failures are not reported as errors.
type logger struct {
	watermill.LoggerAdapter
	slog *slog.Logger
}

// New returns l as Watermill's logger.
func New(l *slog.Logger) watermill.LoggerAdapter {
	return logger{watermill.NewSlogLoggerWithLevelMapping(l, map[slog.Level]slog.Level{
		slog.LevelInfo: slog.LevelDebug,
	}), l}
}

// Trace and Debug return before Watermill builds the fields of a line
// nobody reads: routers, forwarders and subscribers log several per
// message.
func (l logger) Trace(msg string, fields watermill.LogFields) {
	if l.slog.Enabled(context.Background(), watermill.LevelTrace) {
		l.LoggerAdapter.Trace(msg, fields)
	}
}

func (l logger) Debug(msg string, fields watermill.LogFields) {
	if l.slog.Enabled(context.Background(), slog.LevelDebug) {
		l.LoggerAdapter.Debug(msg, fields)
	}
}

func (l logger) Error(msg string, err error, fields watermill.LogFields) {
	if msg == unwrapFailed {
		l.Debug(msg, fields.Add(watermill.LogFields{"err": err.Error()}))
		return
	}
	l.LoggerAdapter.Error(msg, err, fields)
}

func (l logger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return logger{l.LoggerAdapter.With(fields), l.slog}
}
