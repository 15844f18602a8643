package bench

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// plainForwarderTopic is the single watermill-sql topic (and table) the
// plain Watermill outbox writes every event to.
const plainForwarderTopic = "forwarder"

// plainOutbox is the plain Watermill outbox the way its documentation
// builds one: watermill-sql's default PostgreSQL schema and offsets adapter
// (tables placed in the benchmark's schema, nothing else changed), one
// forwarder topic, events written through forwarder.NewPublisher around
// watermill-sql's publisher on the caller's pgx transaction.
type plainOutbox struct {
	schema  string
	adapter wsql.DefaultPostgreSQLSchema
	offsets wsql.DefaultPostgreSQLOffsetsAdapter
}

func (e *env) newPlainOutbox(ctx context.Context, prefix string) (*plainOutbox, func(), error) {
	schema, drop, err := e.newSchema(ctx, prefix)
	if err != nil {
		return nil, nil, err
	}
	o := &plainOutbox{
		schema: schema,
		adapter: wsql.DefaultPostgreSQLSchema{GenerateMessagesTableName: func(topic string) string {
			return qualify(schema, "watermill_"+topic)
		}},
		offsets: wsql.DefaultPostgreSQLOffsetsAdapter{GenerateMessagesOffsetsTableName: func(topic string) string {
			return qualify(schema, "watermill_offsets_"+topic)
		}},
	}
	// The tables come from watermill-sql's own initializing queries, run
	// here once instead of on every Subscribe.
	sq, err := o.adapter.SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams{Topic: plainForwarderTopic})
	if err == nil {
		var oq []wsql.Query
		oq, err = o.offsets.SchemaInitializingQueries(wsql.OffsetsSchemaInitializingQueriesParams{Topic: plainForwarderTopic})
		sq = append(sq, oq...)
	}
	if err == nil {
		err = pgx.BeginFunc(ctx, e.admin, func(tx pgx.Tx) error {
			for _, q := range sq {
				if _, err := tx.Exec(ctx, q.Query, q.Args...); err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err != nil {
		drop()
		return nil, nil, fmt.Errorf("create plain Watermill outbox: %w", err)
	}
	return o, drop, nil
}

// publish writes msgs for Kafka topic in tx.
func (o *plainOutbox) publish(tx pgx.Tx, topic string, msgs ...*message.Message) error {
	pub, err := wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: o.adapter}, nil)
	if err != nil {
		return err
	}
	return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: plainForwarderTopic}).Publish(topic, msgs...)
}

// plainRelay is a running plain Watermill forwarder: watermill-sql
// subscriber (defaults: batch 100, poll interval 1s unless given) into
// watermill-kafka's sync Publisher (Watermill's default Sarama config;
// records keyed by aggregate id like eventline's, so both spread over the
// same partitions).
type plainRelay struct {
	fwd       *forwarder.Forwarder
	pub       *kafka.Publisher
	forwarded atomic.Int64
	done      chan error
	closeOnce sync.Once
}

// startPlainRelay starts the forwarder; pollInterval 0 keeps
// watermill-sql's default (1s).
func (o *plainOutbox) startPlainRelay(ctx context.Context, pool *pgxpool.Pool, brokers []string, pollInterval time.Duration) (*plainRelay, error) {
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(pool), wsql.SubscriberConfig{
		SchemaAdapter:  o.adapter,
		OffsetsAdapter: o.offsets,
		PollInterval:   pollInterval,
	}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers:   brokers,
		Marshaler: kafka.NewWithPartitioningMarshaler(aggregateKey),
	}, watermill.NopLogger{})
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	r := &plainRelay{pub: pub, done: make(chan error, 1)}
	r.fwd, err = forwarder.NewForwarder(sub, countingPublisher{pub, &r.forwarded}, watermill.NopLogger{},
		forwarder.Config{ForwarderTopic: plainForwarderTopic})
	if err != nil {
		_ = sub.Close()
		_ = pub.Close()
		return nil, err
	}
	go func() { r.done <- r.fwd.Run(ctx) }()
	select {
	case <-r.fwd.Running():
	case err := <-r.done:
		_ = pub.Close()
		return nil, fmt.Errorf("plain forwarder stopped at start: %w", err)
	case <-time.After(30 * time.Second):
		r.close()
		return nil, errors.New("plain forwarder did not start")
	}
	return r, nil
}

// close stops the forwarder (the router closes the subscriber) and the
// Kafka publisher.
func (r *plainRelay) close() {
	r.closeOnce.Do(func() {
		_ = r.fwd.Close()
		<-r.done
		_ = r.pub.Close()
	})
}

// countingPublisher counts the messages its publisher accepted.
type countingPublisher struct {
	message.Publisher
	n *atomic.Int64
}

func (p countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	p.n.Add(int64(len(msgs)))
	return nil
}

// Close leaves the wrapped publisher to its owner.
func (p countingPublisher) Close() error { return nil }
