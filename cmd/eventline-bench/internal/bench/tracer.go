package bench

import (
	"context"
	"maps"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// queryCounter is a pgx tracer on one component's pool. It counts what
// the pool sends to PostgreSQL: statements (Query, QueryRow and Exec, BEGIN
// and COMMIT included; each statement of a Batch; CopyFrom), and the round
// trips they cost: one per Query/QueryRow/Exec, per Batch (pgx pipelines its
// statements), per CopyFrom, per Prepare that reached the server (the first
// execution of a statement on a connection, with pgx's default statement
// cache) and per liveness ping pgxpool sends before handing out a
// connection idle for over a second. Connections opened are counted apart.
type queryCounter struct {
	queries      atomic.Int64
	batches      atomic.Int64
	batchQueries atomic.Int64
	copies       atomic.Int64
	prepares     atomic.Int64
	connects     atomic.Int64
	pings        atomic.Int64

	mu     sync.Mutex
	byKind map[string]int64
}

func newQueryCounter() *queryCounter { return &queryCounter{byKind: map[string]int64{}} }

var (
	_ pgx.QueryTracer    = (*queryCounter)(nil)
	_ pgx.BatchTracer    = (*queryCounter)(nil)
	_ pgx.CopyFromTracer = (*queryCounter)(nil)
	_ pgx.PrepareTracer  = (*queryCounter)(nil)
	_ pgx.ConnectTracer  = (*queryCounter)(nil)
)

func (q *queryCounter) kind(sql string) {
	kind := strings.ToUpper(firstWord(sql))
	q.mu.Lock()
	q.byKind[kind]++
	q.mu.Unlock()
}

func (q *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	q.queries.Add(1)
	q.kind(data.SQL)
	return ctx
}

func (q *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (q *queryCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	q.batches.Add(1)
	return ctx
}

func (q *queryCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	q.batchQueries.Add(1)
	q.kind(data.SQL)
}

func (q *queryCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (q *queryCounter) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceCopyFromStartData) context.Context {
	q.copies.Add(1)
	q.kind("COPY")
	return ctx
}

func (q *queryCounter) TraceCopyFromEnd(context.Context, *pgx.Conn, pgx.TraceCopyFromEndData) {}

func (q *queryCounter) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	return ctx
}

// TracePrepareEnd counts a prepare that went to the server: pgx answers
// one already prepared on the connection without a round trip.
func (q *queryCounter) TracePrepareEnd(_ context.Context, _ *pgx.Conn, data pgx.TracePrepareEndData) {
	if !data.AlreadyPrepared {
		q.prepares.Add(1)
	}
}

func (q *queryCounter) TraceConnectStart(ctx context.Context, _ pgx.TraceConnectStartData) context.Context {
	q.connects.Add(1)
	return ctx
}

func (q *queryCounter) TraceConnectEnd(context.Context, pgx.TraceConnectEndData) {}

// shouldPing is pgxpool's default ping rule, counted.
func (q *queryCounter) shouldPing(_ context.Context, p pgxpool.ShouldPingParams) bool {
	if p.IdleDuration > time.Second {
		q.pings.Add(1)
		return true
	}
	return false
}

// snapshot returns the statements (Query/QueryRow/Exec, each statement of
// a Batch, CopyFrom), the round trips without the pings, the pings and
// the statements by first word so far (idle_queries' figures).
func (q *queryCounter) snapshot() (statements, roundTrips, pings int64, byKind map[string]int64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	c := q.count()
	return c.statements(), c.roundTrips() - c.pings, c.pings, maps.Clone(q.byKind)
}

// clientCount is a reading of one or more queryCounters.
type clientCount struct {
	queries, batches, batchQueries, copies, prepares, connects, pings int64
}

// count reads the counters.
func (q *queryCounter) count() clientCount {
	return clientCount{
		queries: q.queries.Load(), batches: q.batches.Load(), batchQueries: q.batchQueries.Load(),
		copies: q.copies.Load(), prepares: q.prepares.Load(), connects: q.connects.Load(), pings: q.pings.Load(),
	}
}

// countAll sums the readings of qs.
func countAll(qs []*queryCounter) clientCount {
	var c clientCount
	for _, q := range qs {
		c = c.add(q.count())
	}
	return c
}

func (c clientCount) add(o clientCount) clientCount {
	return clientCount{
		queries: c.queries + o.queries, batches: c.batches + o.batches, batchQueries: c.batchQueries + o.batchQueries,
		copies: c.copies + o.copies, prepares: c.prepares + o.prepares, connects: c.connects + o.connects, pings: c.pings + o.pings,
	}
}

func (c clientCount) sub(o clientCount) clientCount {
	return clientCount{
		queries: c.queries - o.queries, batches: c.batches - o.batches, batchQueries: c.batchQueries - o.batchQueries,
		copies: c.copies - o.copies, prepares: c.prepares - o.prepares, connects: c.connects - o.connects, pings: c.pings - o.pings,
	}
}

// roundTrips is every exchange with the server that the client waited for.
func (c clientCount) roundTrips() int64 {
	return c.queries + c.batches + c.copies + c.prepares + c.pings
}

// statements is every SQL statement sent.
func (c clientCount) statements() int64 { return c.queries + c.batchQueries + c.copies }
