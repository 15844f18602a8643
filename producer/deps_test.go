package producer_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestTheProducerDoesNotLinkTheConsumer keeps the writing half free of the
// reading half: a service that only publishes links none of the consumer's
// packages. (watermill-sql's own import of Watermill's router middleware
// is not eventline's.)
func TestTheProducerDoesNotLinkTheConsumer(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	out, err := exec.Command("go", "list", "-deps", "github.com/eventline/eventline/producer").CombinedOutput()
	require.NoError(t, err, "go list: %s", out)
	for _, dep := range strings.Fields(string(out)) {
		for _, consumerSide := range []string{"middleware", "versioning", "dedup", "consumer"} {
			require.NotEqual(t, "github.com/eventline/eventline/"+consumerSide, dep)
		}
	}
}
