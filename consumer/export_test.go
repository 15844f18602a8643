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

// SetCoalesce replaces the number of slots of the consumer's coalescer
// (single events delivered at once before they are batched together;
// below 0 turns coalescing off) and, when hook is not nil, has hook told
// of each event handed to it: alone (a slot was free, it is delivered at
// once) or how many events wait for a slot with it.
func SetCoalesce(c *Consumer, slots int, hook func(alone bool, waiting int)) {
	c.coalesce, c.coalesceHook = slots, hook
}
