package txhooks_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/txhooks"
)

func TestSavepointHooksJoinOrLeaveTheTransaction(t *testing.T) {
	var ran []string
	hook := func(s string) func() { return func() { ran = append(ran, s) } }
	require.False(t, txhooks.Add(context.Background(), hook("none")), "no set: the caller runs it")

	ctx, tx := txhooks.New(context.Background())
	require.True(t, txhooks.Add(ctx, hook("tx")))
	kept, sp1 := txhooks.Child(ctx)
	txhooks.Add(kept, hook("released savepoint"))
	sp1.Promote()
	dropped, sp2 := txhooks.Child(ctx)
	txhooks.Add(dropped, hook("rolled-back savepoint"))
	sp2.Drop()
	require.Empty(t, ran, "nothing runs before the commit")
	tx.Run()
	require.Equal(t, []string{"tx", "released savepoint"}, ran)
	tx.Run()
	require.Len(t, ran, 2, "hooks run once")

	orphan, root := txhooks.Child(context.Background())
	txhooks.Add(orphan, hook("orphan"))
	root.Promote()
	root.Run()
	require.Equal(t, "orphan", ran[2], "a child without a parent keeps its hooks for Run")
}

// A hook that panics is reported to the panic handler of the context it
// was registered with, and the hooks after it run.
func TestPanickingHookIsReportedAndTheRestRun(t *testing.T) {
	type who struct{}
	var reported []any
	handler := func(ctx context.Context, v any, stack []byte) {
		reported = append(reported, ctx.Value(who{}), v)
		require.NotEmpty(t, stack)
	}
	ctx, tx := txhooks.New(txhooks.WithPanicHandler(context.Background(), handler))
	var ran []string
	txhooks.Add(ctx, func() { ran = append(ran, "first") })
	txhooks.Add(context.WithValue(ctx, who{}, "b"), func() { panic("boom") })
	sp, child := txhooks.Child(ctx)
	txhooks.Add(sp, func() { ran = append(ran, "savepoint") })
	child.Promote()
	require.NotPanics(t, tx.Run)
	require.Equal(t, []string{"first", "savepoint"}, ran)
	require.Equal(t, []any{"b", "boom"}, reported)
}
