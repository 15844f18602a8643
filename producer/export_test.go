package producer

// Hooks for tests that force an interleaving. Each takes the schema, so
// parallel tests only see their own calls; restore removes the hook.

// SetRebaseHook runs f in RebasePositions after a shard was found ahead of
// the cluster's counter and before it is re-based.
func SetRebaseHook(f func(schema string, shard int)) (restore func()) {
	rebaseHook.Store(&f)
	return func() { rebaseHook.Store(nil) }
}
