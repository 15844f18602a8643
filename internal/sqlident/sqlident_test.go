package sqlident_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/sqlident"
)

func TestValidate(t *testing.T) {
	for _, ok := range []string{"eventline", "_x", "T_1", "a23456789012345678901234567890123456789012345678901234567890123"} {
		require.NoError(t, sqlident.Validate("f", ok), ok)
	}
	for _, bad := range []string{"", "1a", "a-b", `a"b`, "a b", "a;DROP", "é", "pg_outbox", "a234567890123456789012345678901234567890123456789012345678901234"} {
		err := sqlident.Validate("Config.Schema", bad)
		require.ErrorContains(t, err, "Config.Schema", bad)
	}
}

func TestQuote(t *testing.T) {
	require.Equal(t, `"a"."b"`, sqlident.Qualify("a", "b"))
	require.Equal(t, `"a""b"`, sqlident.Quote(`a"b`))
}

func TestText(t *testing.T) {
	require.NoError(t, sqlident.Text("f", "orders-é"))
	require.ErrorContains(t, sqlident.Text("Config.Group", "a\x00b"), "Config.Group")
	require.ErrorContains(t, sqlident.Text("Config.Group", "\xff"), "not valid UTF-8")
}

func TestSQLRendersTheSchemaEverywhere(t *testing.T) {
	got := sqlident.SQL("billing", `SELECT 1 FROM {schema}.processed_events p JOIN {schema}.aggregate_versions v USING (consumer_group)`)
	want := `SELECT 1 FROM "billing".processed_events p JOIN "billing".aggregate_versions v USING (consumer_group)`
	if got != want {
		t.Fatalf("got %s, want %s", got, want)
	}
}
