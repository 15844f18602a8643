package eventline_test

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
)

func TestBackoffOrFillsZeroFields(t *testing.T) {
	def := eventline.Backoff{Initial: time.Second, Max: 10 * time.Second, Multiplier: 2, Jitter: 0.2}
	require.Equal(t, def, eventline.Backoff{}.Or(def))
	// A longer Initial raises the default Max to it.
	require.Equal(t, eventline.Backoff{Initial: time.Minute, Max: time.Minute, Multiplier: 2, Jitter: 0.2},
		eventline.Backoff{Initial: time.Minute}.Or(def))
}

func TestBackoffValidateNamesTheField(t *testing.T) {
	ok := eventline.Backoff{Initial: time.Second, Max: time.Second, Multiplier: 1}
	require.NoError(t, ok.Validate("x.Retry"))
	for name, b := range map[string]eventline.Backoff{
		"Initial":    {Initial: 0, Max: time.Second, Multiplier: 1},
		"Max":        {Initial: time.Second, Max: time.Millisecond, Multiplier: 1},
		"Multiplier": {Initial: time.Second, Max: time.Second, Multiplier: math.NaN()},
		"Jitter":     {Initial: time.Second, Max: time.Second, Multiplier: 1, Jitter: 1.5},
	} {
		require.ErrorContains(t, b.Validate("x.Retry"), "x.Retry."+name, name)
	}
}
