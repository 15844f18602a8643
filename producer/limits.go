package producer

import (
	"encoding/binary"
	"fmt"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline"
)

// Sarama's size estimate of one record (ProducerMessage.ByteSize for record
// batches, Kafka ≥ 0.11): a fixed overhead per record plus, per header, two
// varints' worth of length prefixes. The constants mirror Sarama's
// maximumRecordOverhead and binary.MaxVarintLen32 so the producer refuses
// exactly what Sarama would.
const (
	recordOverhead = 5*binary.MaxVarintLen32 + binary.MaxVarintLen64 + 1
	headerOverhead = 2 * binary.MaxVarintLen32
)

// EncodedRecordSize returns the size Sarama compares with
// Producer.MaxMessageBytes for the Kafka record the relay builds from msg,
// an event message as [eventline.Encode] returns it: the record key (the
// aggregate id), the payload, one header per metadata entry plus
// watermill-kafka's message UUID header, and the per-record overhead. A
// record is sent only when this is at most the relay's MaxMessageBytes.
func EncodedRecordSize(msg *message.Message) int {
	if msg == nil {
		return 0
	}
	size := recordOverhead + len(msg.Metadata.Get(eventline.MetaAggregateID)) + len(msg.Payload)
	size += len(kafka.UUIDHeaderKey) + len(msg.UUID) + headerOverhead
	for k, v := range msg.Metadata {
		size += len(k) + len(v) + headerOverhead
	}
	return size
}

// EventTooLargeError reports an event whose Kafka record would exceed the
// configured maximum. PublishTx returns it before any SQL runs, so the
// caller's transaction stays usable.
type EventTooLargeError struct {
	// Index is the event's position in the PublishTx call.
	Index         int
	EventID       string
	AggregateType string
	AggregateID   string
	// Size is the record size Sarama would compute (for an event whose
	// version is assigned by the outbox, with room for the largest
	// version), in bytes.
	Size int
	// Limit is producer.Config.MaxMessageBytes.
	Limit int
}

func (e *EventTooLargeError) Error() string {
	return fmt.Sprintf("eventline: event %d (id %s, aggregate %s/%s) would be a %d-byte Kafka record, over the %d-byte limit "+
		"(producer.Config.MaxMessageBytes); store large bodies elsewhere and publish a reference to them, or raise the limit "+
		"together with the relay's RelayConfig.MaxMessageBytes and the topic's max.message.bytes",
		e.Index, e.EventID, e.AggregateType, e.AggregateID, e.Size, e.Limit)
}

// Unwrap lets errors.Is(err, ErrEventTooLarge) match.
func (e *EventTooLargeError) Unwrap() error { return ErrEventTooLarge }
