// Package e2e holds end-to-end tests that run the whole pipeline—PublishTx,
// the relay, Kafka and a consumer—against PostgreSQL and kfake, for the
// guarantees no single package can show on its own.
package e2e
