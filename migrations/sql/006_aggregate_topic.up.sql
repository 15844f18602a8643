-- One aggregate, one topic: the producer records the Kafka topic of an
-- aggregate's first published event and refuses events of that aggregate
-- for any other topic, so a consumer group reading the topic sees every
-- version. NULL for aggregates published before this migration: their
-- topic is recorded by their next publish.
ALTER TABLE aggregate_sequences ADD COLUMN topic text;
