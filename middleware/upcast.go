package middleware

import (
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline"
)

// Upcast returns a middleware that hands the handler every event at the
// current payload schema version of its type (see eventline.Upcasters), so
// a handler written for version 3 also accepts events written as version 1
// or 2.
//
// Config.Upcasters applies it to every handler the middleware wraps or
// registers; use Upcast directly only around a handler you pass to Chain
// or Register yourself. Put it inside the eventline middleware, so events
// released from parking pass through it too, and it upcasts when the event
// is handled, not when it is received. In the safe chain (dead letters ▸
// retries ▸ eventline), registered for the sweeper and replays under the
// handler's name:
//
//	upcasting := middleware.Upcast(up)(handler)
//	el.Register(name, upcasting)
//	chain := el.Chain(upcasting)
//	router.AddConsumerHandler(name, topic, sub, func(msg *message.Message) error {
//		_, err := chain(msg)
//		return err
//	})
//
// When an event needs upcasting, the handler receives a copy of the
// message whose payload and event_version metadata are the upcast ones,
// with the upcast event in its context ([EventFromContext]); the original
// message keeps the bytes as written, so what is parked or dead-lettered
// is the event as it was published. An event the registry cannot upcast
// (a version newer than the current one, older than the chain, or a step
// that fails) never reaches the handler: it fails with a permanent error
// naming the versions, and is dead-lettered. Events already at the current
// version, and types the registry does not know, pass through untouched.
func Upcast(up *eventline.Upcasters) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			e, err := eventOf(msg)
			if err != nil {
				return nil, err
			}
			u, err := up.Upcast(e)
			if err != nil {
				return nil, Permanent(fmt.Errorf("message %s: %w", msg.UUID, err))
			}
			if u.SchemaVersion == e.SchemaVersion {
				return h(msg)
			}
			c := msg.Copy()
			c.Payload = u.Payload
			c.Metadata.Set(eventline.MetaEventVersion, strconv.Itoa(u.SchemaVersion))
			c.SetContext(ContextWithEvent(msg.Context(), u))
			return h(c)
		}
	}
}
