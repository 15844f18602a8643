package producer

// Hooks for tests that force an interleaving. Each is called with the
// schema, so a test acts on its own relay's calls only; one test at a time
// may set each hook, and restore removes it.

// SetBeforeSendHook runs f in the relay's publish path before the lease
// check that precedes each Kafka send.
func SetBeforeSendHook(f func(schema string, shard int, eventID string)) (restore func()) {
	beforeSendHook.Store(&f)
	return func() { beforeSendHook.Store(nil) }
}

// SetLeaseTimerHook runs f when a shard's lease timer fires, before the
// shard is stopped.
func SetLeaseTimerHook(f func(schema string, shard int)) (restore func()) {
	leaseTimerHook.Store(&f)
	return func() { leaseTimerHook.Store(nil) }
}

// OwnedShards returns the shards r is relaying now, in order.
func OwnedShards(r *Relay) []int { return r.ownedShards() }

// ShardCount returns r's shard count, or 0 while it is not known.
func ShardCount(r *Relay) int { return r.shardCount() }

// Polls returns how many times r's poller has looked at its waiting shards.
func Polls(r *Relay) int64 { return r.poller.polls.Load() }
