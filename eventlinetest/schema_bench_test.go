package eventlinetest

import (
	"context"
	"testing"
)

// BenchmarkSchemaReset compares resetting the run schema with creating,
// migrating and dropping one.
func BenchmarkSchemaReset(b *testing.B) {
	ctx := context.Background()
	setup := SQL(`CREATE TABLE invoices (order_id text PRIMARY KEY, amount_cents bigint NOT NULL)`, `INSERT INTO invoices VALUES ('seed', 1)`)
	b.Run("create-migrate-drop", func(b *testing.B) {
		for b.Loop() {
			env, err := newSchema(ctx, databaseURL(""), setup)
			if err != nil {
				b.Fatal(err)
			}
			env.close(ctx)
		}
	})
	b.Run("reset", func(b *testing.B) {
		env, err := newSchema(ctx, databaseURL(""), setup)
		if err != nil {
			b.Fatal(err)
		}
		defer env.close(ctx)
		for b.Loop() {
			if err := env.reset(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
}
