// Package migrations owns eventline's database schema: embedded, numbered
// NNN_name.up.sql / NNN_name.down.sql files tracked in a schema_migrations
// table, plus the outbox shard tables, which are generated from
// watermill-sql's own PostgreSQL schema adapter so the relay reads exactly
// what the producer writes.
//
// Apply them with [Up] (or `eventline migrate up`) before starting producers
// or consumers. Nothing in eventline creates tables at runtime, and never
// inside a caller's transaction. Teams with their own migration tool can take
// the files from [FS] and [ShardTableSQL] instead.
package migrations
