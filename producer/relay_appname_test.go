package producer

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

// TestRelayAppNameKeepsTheOperatorsName: the relay's sessions keep the
// name the operator gave the pool and add the relay's identity, within
// PostgreSQL's 63 bytes.
func TestRelayAppNameKeepsTheOperatorsName(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"":                              "eventline-relay",
		"   ":                           "eventline-relay",
		"eventline-relay":               "eventline-relay",
		"billing-svc":                   "billing-svc (eventline-relay)",
		"billing-svc (eventline-relay)": "billing-svc (eventline-relay)",
		"eventline relay":               "eventline relay (eventline-relay)",
		strings.Repeat("x", 60):         strings.Repeat("x", 45) + " (eventline-relay)",
		strings.Repeat("é", 30):         strings.Repeat("é", 22) + " (eventline-relay)",
	} {
		require.Equal(t, want, relayAppName(in), "from %q", in)
	}
	rapid.Check(t, func(t *rapid.T) {
		name := rapid.OneOf(rapid.String(), rapid.StringMatching(`[ -~]{0,80}`)).Draw(t, "name")
		got := relayAppName(name)
		if len(got) > maxAppNameBytes {
			t.Fatalf("%q is %d bytes, over PostgreSQL's %d", got, len(got), maxAppNameBytes)
		}
		if utf8.ValidString(name) && !utf8.ValidString(got) {
			t.Fatalf("%q cut %q inside a character", got, name)
		}
		if relayAppName(got) != got {
			t.Fatalf("not idempotent: %q then %q", got, relayAppName(got))
		}
		trimmed := strings.TrimSpace(name)
		if got == relayIdentity {
			if utf8.ValidString(name) && trimmed != "" && trimmed != relayIdentity {
				t.Fatalf("%q lost the operator's name %q", got, name)
			}
			return
		}
		if kept := strings.TrimSuffix(got, " ("+relayIdentity+")"); !strings.HasPrefix(trimmed, kept) {
			t.Fatalf("%q does not keep the start of the operator's name %q", got, name)
		}
	})
}
