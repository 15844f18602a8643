package middleware

// BatchArrivals returns how many of b's members have reached the composed
// middleware and wait there for the batch (tests wait on it instead of
// sleeping).
func BatchArrivals(b *Batch) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, s := range b.slots {
		if s.arrival != nil {
			n++
		}
	}
	return n
}
