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
