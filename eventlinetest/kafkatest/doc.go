// Package kafkatest gives a test a Kafka cluster in one call: an in-process
// one (franz-go's kfake, which any client, Sarama included, reaches over
// TCP) on a free port, or the real cluster named by KAFKA_BROKERS, with the
// test's topics created and everything cleaned up when the test ends.
//
//	k := kafkatest.Start(t, "orders")
//	c, err := consumer.New(pool, consumer.Config{Config: middleware.Config{Group: "billing"}, Brokers: k.Brokers, Topics: []string{"orders"}})
//
// Like a production cluster, the in-process one creates no topic on first
// use (Config.AutoCreateTopics changes that): create every topic your
// code uses. On a real cluster,
// use Topic for names no earlier run used; the topics Start created are
// deleted at the end.
//
// Publish puts events on a topic the way eventline's relay does (encoded
// by eventline.Encode, keyed by aggregate id), so a test can feed a
// consumer without a producer and a relay, and deliver events twice or
// out of order on purpose. New starts a cluster outside a test, for a
// TestMain that shares one among a package's tests.
package kafkatest
