package producer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"testing"

	"github.com/IBM/sarama"
	"github.com/eapache/go-resiliency/breaker"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
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
