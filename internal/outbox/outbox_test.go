package outbox_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/outbox"
)

// The shard mapping is part of the on-disk contract: changing it would send
// an aggregate's next events to another shard than its pending ones. These
// golden values must never change.
func TestShardForIsStable(t *testing.T) {
	for _, c := range []struct {
		typ, id string
		shards  int
		want    int
	}{
		{"order", "1", 8, 4},
		{"order", "o-42", 8, 7},
		{"account", "acc-7", 8, 5},
		{"order", "1", 1, 0},
	} {
		require.Equal(t, c.want, outbox.ShardFor(c.typ, c.id, c.shards), "%s/%s over %d shards", c.typ, c.id, c.shards)
	}
	// Type and id are separated, so ("ab","c") and ("a","bc") differ.
	require.NotEqual(t, outbox.ShardFor("ab", "c", 1024), outbox.ShardFor("a", "bc", 1024))
	spread := map[int]bool{}
	for i := 0; i < 64; i++ {
		spread[outbox.ShardFor("t", fmt.Sprint(i), 8)] = true
	}
	require.Len(t, spread, 8, "64 aggregates cover all 8 shards")
}
