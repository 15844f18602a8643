package producer

import (
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/eventline/eventline/internal/outbox"
)

// deferredAck is the "query" relayOffsetsAdapter gives watermill-sql for
// acknowledging a batch. relayTx recognizes it and sends nothing: the shard
// writes the position itself once Kafka has answered (finish).
const deferredAck = "-- eventline: the relay records the position after Kafka acknowledged the batch"

// relayOffsetsAdapter is watermill-sql's PostgreSQL offsets adapter with the
// two statements that would make a relay transaction hold a transaction id
// replaced:
//
//   - NextOffsetQuery fences concurrent readers of the shard with a
//     transaction-scoped advisory lock instead of SELECT … FOR UPDATE (a
//     row lock assigns a transaction id);
//   - AckMessageQuery is deferred to the end of the batch.
//
// PostgreSQL's xmin horizon counts every transaction holding an id, and the
// outbox is read only below it, so a relay transaction that held one while
// waiting for Kafka would hold back every other shard's newest rows. Now the
// id is taken by the final position write, just before commit.
//
// The advisory lock only fences: ownership is the relay's session lock. Two
// relays that both believe they own a shard (the owner's lock connection
// died a moment ago) never read it at once; the one that does not get the
// fence sees no rows.
type relayOffsetsAdapter struct {
	wsql.DefaultPostgreSQLOffsetsAdapter
	nextOffset string
	fenceNS    int64
	shard      int
}

// nextOffsetSQL reads the relays' position ($1 their consumer group) if
// the shard's read fence ($2 namespace, $3 shard) can be taken, and then
// applies the relay transaction's settings (relaySettings) in the same
// statement: watermill-sql materializes this query once per read (a CTE
// its select refers to three times), and the row it returns, the one case
// in which the transaction holds the fence and may write, computes them.
var nextOffsetSQL = `SELECT offset_acked, last_processed_transaction_id, ` + relaySettings + ` FROM {offsets}
	WHERE consumer_group = $1 AND pg_try_advisory_xact_lock($2::int, $3::int)`

func newRelayOffsetsAdapter(schema string, shard int) relayOffsetsAdapter {
	return relayOffsetsAdapter{
		DefaultPostgreSQLOffsetsAdapter: outbox.OffsetsAdapter(schema),
		nextOffset:                      outbox.SQL(schema, shard, nextOffsetSQL),
		fenceNS:                         outbox.FenceNamespace(schema),
		shard:                           shard,
	}
}

func (a relayOffsetsAdapter) NextOffsetQuery(params wsql.NextOffsetQueryParams) (wsql.Query, error) {
	return wsql.Query{
		Query: a.nextOffset,
		Args:  []any{params.ConsumerGroup, a.fenceNS, a.shard},
	}, nil
}

func (a relayOffsetsAdapter) AckMessageQuery(wsql.AckMessageQueryParams) (wsql.Query, error) {
	return wsql.Query{Query: deferredAck}, nil
}

// BeforeSubscribingQueries is empty: the shard writes the relay's zero
// position itself before it subscribes (shardRunner.setUp), under READ
// COMMITTED. watermill-sql would run it in a relay transaction, under
// REPEATABLE READ, where it fails with a serialization error whenever the
// previous owner moved the position meanwhile.
func (a relayOffsetsAdapter) BeforeSubscribingQueries(wsql.BeforeSubscribingQueriesParams) ([]wsql.Query, error) {
	return nil, nil
}
