// Package outbox names the outbox shard tables and maps aggregates to shards.
// The producer, the relay and the migrations share it, so they can never
// disagree about where an event is stored.
package outbox

import (
	"hash/fnv"
	"strconv"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/eventline/eventline/internal/sqlident"
)

// RelayConsumerGroup is the watermill-sql consumer group under which relays
// record their progress in each shard's offsets table.
const RelayConsumerGroup = "eventline_relay"

// NotifyChannel is the PostgreSQL NOTIFY channel the outbox tables signal on
// after an insert; the payload is "<schema>.<shard>".
const NotifyChannel = "eventline_outbox"

// MaxShards bounds the shard count.
const MaxShards = 1024

// Topic is the watermill-sql topic of a shard.
func Topic(shard int) string { return "outbox_" + strconv.Itoa(shard) }

// Table is the unquoted name of a shard's messages table.
func Table(shard int) string { return Topic(shard) }

// OffsetsTable is the unquoted name of a shard's offsets table.
func OffsetsTable(shard int) string { return Topic(shard) + "_offsets" }

// ShardFor maps an aggregate to a shard with a stable hash (FNV-1a, 64 bit)
// of its type and id. The mapping is part of the on-disk contract: every
// event of one aggregate lands in the same shard for a given shard count.
func ShardFor(aggregateType, aggregateID string, shards int) int {
	h := fnv.New64a()
	_, _ = h.Write([]byte(aggregateType))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(aggregateID))
	return int(h.Sum64() % uint64(shards))
}

// SchemaAdapter returns watermill-sql's default PostgreSQL schema adapter with
// the shard tables placed in schema. batchSize is the relay's select batch
// (0 means watermill-sql's default of 100). Schema initialization runs
// without watermill-sql's own transaction: migrations run it inside theirs.
func SchemaAdapter(schema string, batchSize int) wsql.DefaultPostgreSQLSchema {
	return wsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(topic string) string {
			return sqlident.Qualify(schema, topic)
		},
		SubscribeBatchSize:                 batchSize,
		InitializeSchemaWithoutTransaction: true,
	}
}

// OffsetsAdapter returns watermill-sql's default PostgreSQL offsets adapter
// with the offsets tables placed in schema.
func OffsetsAdapter(schema string) wsql.DefaultPostgreSQLOffsetsAdapter {
	return wsql.DefaultPostgreSQLOffsetsAdapter{
		GenerateMessagesOffsetsTableName: func(topic string) string {
			return sqlident.Qualify(schema, topic+"_offsets")
		},
	}
}
