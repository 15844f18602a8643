package producer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/eapache/go-resiliency/breaker"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/backoff"
)

// Outages and producer-state hiccups must never count towards dead-lettering
// a message; only failures that are the message's own may.
func TestClassify(t *testing.T) {
	cases := map[failureKind][]error{
		failPermanent: {
			sarama.ErrMessageSizeTooLarge, sarama.ErrInvalidTopic, sarama.ErrTopicAuthorizationFailed,
			sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes"),
			&permanentError{&eventline.InvalidEventError{Field: "event_id", Reason: "missing"}},
		},
		failUnavailable: {
			sarama.ErrOutOfBrokers, sarama.ErrNotConnected, breaker.ErrBreakerOpen,
			sarama.ErrNotEnoughReplicas, sarama.ErrLeaderNotAvailable, sarama.ErrRequestTimedOut,
			sarama.ErrInvalidProducerEpoch, sarama.ErrOutOfOrderSequenceNumber, sarama.ErrUnknownProducerID,
			errFlushTimeout, context.DeadlineExceeded,
			&net.OpError{Op: "dial", Err: errors.New("connection refused")},
			io.EOF, io.ErrUnexpectedEOF, fmt.Errorf("wrapped: %w", io.EOF),
			fmt.Errorf("wrapped: %w", sarama.ErrOutOfBrokers),
			&missingTopicError{topic: "t", err: breaker.ErrBreakerOpen},
		},
		failRetry: {
			sarama.ErrUnknownTopicOrPartition, sarama.ErrUnknown, errors.New("something else"),
			&missingTopicError{topic: "t", err: sarama.ErrUnknownTopicOrPartition},
		},
	}
	for want, errs := range cases {
		for _, err := range errs {
			require.Equal(t, want, classify(err), "%v", err)
		}
	}
}

// While Kafka is unreachable a shard's wait doubles from Backoff.Initial
// up to 5 s, so it resumes within 5 s of Kafka's return. Before,
// the cap was 30 s: after a 20 s outage the relay caught up 7–13 s late
// (internal/e2e.TestKafkaOutageLosesNothing).
func TestUnavailableWaitDoublesUpToFiveSeconds(t *testing.T) {
	for _, c := range []struct {
		first time.Duration
		n     int
		want  time.Duration
	}{
		{time.Second, 1, time.Second},
		{time.Second, 2, 2 * time.Second},
		{time.Second, 3, 4 * time.Second},
		{time.Second, 4, 5 * time.Second},
		{time.Second, 1000, 5 * time.Second},
		{20 * time.Millisecond, 3, 80 * time.Millisecond},
		{time.Minute, 1, 5 * time.Second},
	} {
		if got := backoff.Delay(unavailableBackoff(eventline.Backoff{Initial: c.first}), c.n); got != c.want {
			t.Errorf("unavailable wait %d from %s = %s, want %s", c.n, c.first, got, c.want)
		}
	}
}

// A record Kafka refuses as too large (MESSAGE_TOO_LARGE) is at fault
// only if it was sent alone: Sarama batches records up to
// RelayConfig.MaxMessageBytes, and a topic whose max.message.bytes is
// smaller refuses a batch of records that each fit
// (internal/e2e.TestTopicLimitBelowTheRelaysDeadLettersOnlyTheTooLargeEvent
// dead-lettered 100 such records before). Sarama's own size check is about
// the record alone.
func TestClassifyItemTooLarge(t *testing.T) {
	tooLarge := &recordTooLargeError{topic: "t", recordBytes: 2000, topicLimit: 1024, relayLimit: DefaultMaxMessageBytes, err: sarama.ErrMessageSizeTooLarge}
	require.Equal(t, failBatchTooLarge, classifyItem(&item{err: tooLarge}))
	require.Equal(t, failBatchTooLarge, classifyItem(&item{err: sarama.ErrMessageSizeTooLarge}))
	require.Equal(t, failPermanent, classifyItem(&item{err: tooLarge, alone: true}))
	require.Equal(t, failPermanent, classifyItem(&item{err: sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes")}))
	require.Equal(t, failUnavailable, classifyItem(&item{err: sarama.ErrOutOfBrokers}))
	for _, s := range []string{`topic "t"`, "max.message.bytes, 1024 bytes", "RelayConfig.MaxMessageBytes (1048576 bytes)", "about 2000 bytes"} {
		require.Contains(t, tooLarge.Error(), s)
	}
}
