// Package delivery is what travels with a message through eventline's
// consumer chain, shared by the consumer's subscriber, which puts it in
// the message context, and the middleware, which reads it: where the
// message came from ([Source]) and, for a lane's events handed out
// together, the [Batch] they are applied in.
package delivery
