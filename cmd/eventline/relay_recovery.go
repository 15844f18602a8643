package main

import (
	"context"
	"fmt"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/sqlident"
)

const rebasePositionsHelp = `
Repairs the outbox after it was moved to a PostgreSQL cluster whose
transaction counter is lower (pg_dump and restore, a logical-replication
cutover): relay positions and rows then carry transaction ids this cluster has
not handed out, and nothing is relayed (eventline status warns, and the relay
logs an error). For every such shard, in one transaction holding the shard's
read fence: rows from the old cluster are re-based (relayed ones before the
position, the others after it, in insertion order) and the position is reset,
so the relay sends what it had not sent, then everything written since.
Events relayed before the move may be sent again (consumers skip them);
nothing is lost. Producers may keep writing: the rows to re-base are chosen
by the statement that moves them, under its own snapshot, so an event
committed meanwhile is never taken for one relayed before the move. Shards
that are fine are left alone. Stop the relays first.`

func relayRebasePositions(ctx context.Context, inv *invocation) error {
	fs := inv.fs
	dryRun := fs.Bool("dry-run", false, "report what would change, change nothing")
	if _, err := inv.parse(); err != nil {
		return err
	}
	pool, err := inv.pool(ctx)
	if err != nil {
		return err
	}
	res, err := admin.RebasePositions(ctx, pool, inv.globals.schema, *dryRun)
	if err != nil {
		return err
	}
	w := inv.stdout
	verb := "re-based"
	if *dryRun {
		verb = "would re-base"
	}
	n := 0
	for _, r := range res {
		if !r.Ahead() {
			continue
		}
		n++
		fmt.Fprintf(w, "shard %d: %s (position xid %d, newest row xid %d, cluster's next xid %d): %d rows relayed before the move, %d to relay\n",
			r.Shard, verb, r.Position, r.NewestRow, r.Counter, r.Relayed, r.Pending)
	}
	if n == 0 {
		fmt.Fprintln(w, "every shard's position is behind this cluster's transaction counter: nothing to do")
	}
	return nil
}

const advanceSequencesHelp = `
Moves every aggregate's producer sequence (aggregate_sequences) up to the
highest version any consumer group holds for it: applied, parked, held as
late, or dead-lettered (whatever the dead letter's status). Run it after a
failover that lost commits (asynchronous replication): the producer's
sequences rolled back but the consumers did not, and new events would reuse
versions consumers have already seen, and be discarded as stale.
Sequences only move up. When the consumers keep their tables in another
database, give it with -consumer-database-url (and -consumer-schema), and run
the command once per consumer database.`

func relayAdvanceSequences(ctx context.Context, inv *invocation) error {
	fs := inv.fs
	consumerURL := fs.String("consumer-database-url", "", "the consumers' database, when it is not the producer's (default: the producer's)")
	consumerSchema := fs.String("consumer-schema", "", "the consumers' schema (default: -schema)")
	dryRun := fs.Bool("dry-run", false, "report what would change, change nothing")
	if _, err := inv.parse(); err != nil {
		return err
	}
	g := inv.globals
	if *consumerSchema == "" {
		*consumerSchema = g.schema
	}
	if err := sqlident.Validate("-consumer-schema", *consumerSchema); err != nil {
		return usageErrorf("%v", err)
	}
	pool, err := inv.pool(ctx)
	if err != nil {
		return err
	}
	consumers := pool
	if *consumerURL != "" {
		db := database{url: *consumerURL, what: "the consumers' database", flag: "-consumer-database-url"}
		if consumers, err = inv.openPool(ctx, db, 2); err != nil {
			return err
		}
	}
	res, err := admin.AdvanceSequences(ctx, pool, g.schema, consumers, *consumerSchema, *dryRun)
	if err != nil {
		return err
	}
	verb := "advanced"
	if *dryRun {
		verb = "would advance"
	}
	fmt.Fprintf(inv.stdout, "%s %d of %d aggregate sequences consumers have seen\n", verb, res.Advanced, res.Aggregates)
	if res.KeysTooLong > 0 {
		fmt.Fprintf(inv.stdout, "left out %d aggregates whose type and id are too long for a sequence (dead-lettered records no producer could have published)\n", res.KeysTooLong)
	}
	return nil
}
