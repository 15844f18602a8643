package main

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRSSReadsAProcesssMemory(t *testing.T) {
	now, peak, err := rss(os.Getpid())
	require.NoError(t, err)
	require.Positive(t, now)
	require.GreaterOrEqual(t, peak, now)
}
