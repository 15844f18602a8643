package kafkatest

import (
	"errors"

	"github.com/IBM/sarama"
)

func asTopicError(err error, target **sarama.TopicError) bool { return errors.As(err, target) }
