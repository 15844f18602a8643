package consumer

import (
	"context"
	"time"
)

// SetSleep replaces the consumer's retry and wait timers (tests check the
// schedule without waiting).
func SetSleep(c *Consumer, sleep func(ctx context.Context, d time.Duration) error) { c.sleep = sleep }
