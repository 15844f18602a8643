package consumer

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/kafkaconf"
)

func TestSubscribeAfterCloseFails(t *testing.T) {
	s := newSubscriber(subscriberConfig{Brokers: []string{"127.0.0.1:9092"}, Group: "g", SaramaConfig: kafkaconf.Consumer("g"),
		Lanes: 1, BatchSize: 1})
	require.NoError(t, s.Close())
	_, err := s.Subscribe(context.Background(), "t")
	require.ErrorContains(t, err, "closed")
}
