package middleware_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/migrations"
)

func failWith(err error) message.HandlerFunc {
	return func(*message.Message) ([]*message.Message, error) { return nil, err }
}

// A message that cannot be dead-lettered to Kafka as it is (5 MiB payload,
// a header with a NUL byte and invalid UTF-8, an event id too long for an
// index) is kept whole in held_events and acknowledged.
func TestDeadLetterKeepsAnyMessageByteForByte(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1, MaxConns: 2})
	dl, err := middleware.New(env.Pool, middleware.Config{Group: group, Schema: env.Schema, Logger: quiet()})
	require.NoError(t, err)

	payload := bytes.Repeat([]byte{0, 0xff, 'x'}, 5<<20/3)
	msg := message.NewMessage("uuid-\xff\x00", payload)
	msg.Metadata.Set(eventline.MetaEventID, randomText(1<<20))
	msg.Metadata.Set(eventline.MetaEventType, "order.created")
	msg.Metadata.Set(eventline.MetaAggregateType, "order")
	msg.Metadata.Set(eventline.MetaAggregateID, "o-1")
	msg.Metadata.Set(eventline.MetaAggregateVersion, "7")
	msg.Metadata.Set("x-binary", "nul\x00 and \xc3\x28 invalid")
	msg.Metadata.Set("x-\xff-key", "v")
	want := map[string]string(msg.Metadata)
	want = cloneMap(want)

	out, err := dl.DeadLetters(failWith(middleware.Permanent(errors.New("no handler for \x00 type"))))(msg)
	require.NoError(t, err, "the message is acknowledged once its dead letter is written")
	require.Empty(t, out)

	list, err := held.New(env.Schema).List(context.Background(), env.Pool, held.Filter{Group: group})
	require.NoError(t, err)
	require.Len(t, list, 1)
	d := list[0]
	require.Equal(t, "uuid-\xff\x00", d.MessageUUID)
	require.True(t, bytes.Equal(payload, d.Payload), "payload byte for byte")
	require.Equal(t, want, d.Metadata, "headers byte for byte")
	require.Equal(t, held.KindDeadLetter, d.Kind)
	require.Equal(t, dedup.KindPermanent, d.Cause)
	require.Contains(t, d.Reason, "no handler for \uFFFD type", "the reason is stored as text")
	require.Equal(t, "order", d.AggregateType)
	require.Equal(t, "o-1", d.AggregateID)
	require.EqualValues(t, 7, d.AggregateVersion)
	require.Equal(t, held.StatusHeld, d.Status)
	rebuilt := d.Message()
	require.Equal(t, msg.UUID, rebuilt.UUID)
	require.Equal(t, want, map[string]string(rebuilt.Metadata))
}

func cloneMap(m map[string]string) map[string]string {
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// A dead letter that cannot be written (here: the table does not exist
// yet) is retried, the message held, until the write succeeds; a shutdown
// leaves it unacknowledged.
func TestDeadLetterIsNeverAcknowledgedWithoutItsRow(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	schema := pgtest.NewSchemaName(t)
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	c := &clock{}
	c.onWait = func(n int) {
		if n == 3 { // the operator runs the migrations during the third wait
			require.NoError(t, migrations.Up(context.Background(), pool, migrations.Config{Schema: schema, Shards: 1}))
		}
	}
	dl, err := middleware.New(pool, middleware.Config{Group: group, Schema: schema, Logger: quiet()})
	require.NoError(t, err)
	msg := consumertest.Message(t, consumertest.Event("a", 1))
	msg.SetContext(backoff.WithSleep(context.Background(), c.sleep))
	_, err = dl.DeadLetters(failWith(errors.New("handler bug")))(msg)
	require.NoError(t, err)
	require.Equal(t, ms(250, 500, 1000), c.recorded())
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM `+sqlident.Qualify(schema, "held_events")+` WHERE kind = 'dead_letter' AND cause = 'failed'`))

	// Shutdown while the write keeps failing: not acknowledged.
	ctx, cancel := context.WithCancel(context.Background())
	dl2, err := middleware.New(pool, middleware.Config{Group: group, Schema: "no_such_schema_" + randomHex(), Logger: quiet()})
	require.NoError(t, err)
	msg.SetContext(backoff.WithSleep(ctx, (&clock{onWait: func(n int) {
		if n == 2 {
			cancel()
		}
	}}).sleep))
	_, err = dl2.DeadLetters(failWith(errors.New("handler bug")))(msg)
	require.ErrorContains(t, err, "stays unacknowledged")
}

func TestDeadLetterLeavesOutagesShutdownsAndBadChainsUnacknowledged(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1, MaxConns: 2})
	dl, err := middleware.New(env.Pool, middleware.Config{Group: group, Schema: env.Schema, Logger: quiet()})
	require.NoError(t, err)
	for _, e := range []error{
		fmt.Errorf("begin: %w: connection refused", middleware.ErrInfrastructure),
		errDBDown,
		&middleware.CompositionError{Problem: "p", Fix: "f"},
	} {
		_, err := dl.DeadLetters(failWith(e))(message.NewMessage("m", nil))
		require.ErrorIs(t, err, e)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msg := message.NewMessage("m", nil)
	msg.SetContext(ctx)
	_, err = dl.DeadLetters(failWith(errors.New("retry cut short")))(msg)
	require.Error(t, err, "a message whose context ended (shutdown) is not dead-lettered")
	require.Equal(t, 0, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(env.Schema, "held_events")))

}
