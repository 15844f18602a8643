package consumer

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/middleware"
)

func TestSubscribeAfterCloseFails(t *testing.T) {
	s := newSubscriber(Config{Config: middleware.Config{Group: "g"}, Brokers: []string{"127.0.0.1:9092"}, SaramaConfig: kafkaconf.Consumer("g"),
		Lanes: 1, BatchSize: 1}, 0, nil, nil, nil)
	require.NoError(t, s.Close())
	_, err := s.Subscribe(context.Background(), "t")
	require.ErrorContains(t, err, "closed")
}
