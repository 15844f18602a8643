package nilcheck_test

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/internal/nilcheck"
)

func TestIsNil(t *testing.T) {
	var pool *pgxpool.Pool
	var m map[string]int
	for name, c := range map[string]struct {
		v    any
		want bool
	}{
		"untyped nil":  {nil, true},
		"nil pointer":  {pool, true},
		"nil map":      {m, true},
		"real pointer": {&pgxpool.Pool{}, false},
		"value":        {3, false},
	} {
		if got := nilcheck.IsNil(c.v); got != c.want {
			t.Errorf("%s: IsNil = %v, want %v", name, got, c.want)
		}
	}
}
