package versioning_test

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/versioning"
)

// TestNewStatusCollectorRefusesANilPool: a collector built around a nil
// *pgxpool.Pool panicked in every scrape (Prometheus recovered the panic
// and failed the scrape); NewStatusCollector returns an error naming the
// argument instead.
func TestNewStatusCollectorRefusesANilPool(t *testing.T) {
	var nilPool *pgxpool.Pool
	_, err := versioning.NewStatusCollector(nilPool, "eventline")
	require.ErrorContains(t, err, "versioning.NewStatusCollector: db is nil")
	_, err = versioning.NewStatusCollector(nil, "eventline")
	require.ErrorContains(t, err, "versioning.NewStatusCollector: db is nil")
}
