package admin

// SetRebaseHook runs f in RebasePositions after a shard was found ahead of
// the cluster's counter and before it is re-based, for a test that forces
// an interleaving; one test at a time may set it, and restore removes it.
func SetRebaseHook(f func(schema string, shard int)) (restore func()) {
	rebaseHook.Store(&f)
	return func() { rebaseHook.Store(nil) }
}
