package consumer

import (
	"context"
	"time"

	"github.com/eventline/eventline/middleware"
)

// SetSleep replaces the consumer's retry and wait timers (tests check the
// schedule without waiting).
func SetSleep(c *Consumer, sleep func(ctx context.Context, d time.Duration) error) { c.sleep = sleep }

// Eventline is the middleware the consumer runs, to call its handler
// chain without Kafka.
func Eventline(c *Consumer) *middleware.Eventline { return c.el }
