package delivery

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Source says where a message came from: the handler it is delivered to
// and, for a Kafka record, its topic, partition, offset and key. Dead
// letters record it, parked events record the handler, and replays use it
// to run a message through the handler it arrived on.
//
// A Watermill Router and watermill-kafka's subscriber put these values in
// the message context themselves; the consumer's subscriber and replays
// set them with [WithSource].
type Source struct {
	// Handler is the Watermill handler name.
	Handler string
	// Topic is the topic the message was consumed from.
	Topic string
	// FromKafka is true when Partition, Offset and Key are known.
	FromKafka bool
	// Partition and Offset locate the Kafka record; Key is its key (nil
	// when it had none).
	Partition int32
	Offset    int64  // see Partition
	Key       []byte // see Partition
	// Timestamp is the Kafka record's timestamp (when the relay produced
	// it, or when the broker appended it with LogAppendTime); zero when
	// unknown.
	Timestamp time.Time
}

type sourceKey struct{}

// WithSource returns ctx carrying s. Its non-empty fields take precedence
// over what a Router or watermill-kafka's subscriber set.
func WithSource(ctx context.Context, s Source) context.Context {
	return context.WithValue(ctx, sourceKey{}, s)
}

// SourceOf returns where the message of ctx came from, from [WithSource],
// the Watermill Router (handler name, topic) and watermill-kafka's
// subscriber (partition, offset, key), in that order.
func SourceOf(ctx context.Context) Source {
	s, _ := ctx.Value(sourceKey{}).(Source)
	if s.Handler == "" {
		s.Handler = message.HandlerNameFromCtx(ctx)
	}
	if s.Topic == "" {
		s.Topic = message.SubscribeTopicFromCtx(ctx)
	}
	if !s.FromKafka {
		p, okp := kafka.MessagePartitionFromCtx(ctx)
		o, oko := kafka.MessagePartitionOffsetFromCtx(ctx)
		if okp && oko {
			s.FromKafka, s.Partition, s.Offset = true, p, o
			s.Key, _ = kafka.MessageKeyFromCtx(ctx)
		}
	}
	if s.Timestamp.IsZero() {
		s.Timestamp, _ = kafka.MessageTimestampFromCtx(ctx)
	}
	return s
}
