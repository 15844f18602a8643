-- Consumer dead letters: messages a consumer group gave up on, kept whole
-- in the consumer's own database, next to processed_events, parked and
-- skipped rows. No size limit and no broker that can refuse them, so a
-- record that cannot be dead-lettered to Kafka still leaves its partition.
-- Listed, replayed (by a running consumer of the group) and discarded with
-- `eventline consumer-dlq`.
CREATE TABLE consumer_dead_letters (
    id                  bigserial   PRIMARY KEY,
    consumer_group      text        NOT NULL,
    topic               text        NOT NULL DEFAULT '',
    -- The Watermill handler the message was delivered to; a replay runs
    -- it through the same handler.
    handler             text        NOT NULL DEFAULT '',
    -- Where the Kafka record was, when it came from Kafka.
    kafka_partition     integer,
    kafka_offset        bigint,
    kafka_key           bytea,
    -- The message byte for byte: headers are bytea so NUL bytes and
    -- invalid UTF-8 survive.
    message_uuid        bytea       NOT NULL,
    payload             bytea       NOT NULL,
    header_keys         bytea[]     NOT NULL,
    header_values       bytea[]     NOT NULL,
    -- From the envelope when it decodes, for listing and replay order. Not
    -- indexed: a hostile record may make them arbitrarily long.
    event_id            text        NOT NULL DEFAULT '',
    event_type          text        NOT NULL DEFAULT '',
    aggregate_type      text        NOT NULL DEFAULT '',
    aggregate_id        text        NOT NULL DEFAULT '',
    aggregate_version   bigint      NOT NULL DEFAULT 0,
    -- permanent, retries_exhausted, failed, or a component's own kind.
    kind                text        NOT NULL,
    reason              text        NOT NULL,
    dead_at             timestamptz NOT NULL DEFAULT now(),
    times_dead          integer     NOT NULL DEFAULT 1,
    status              text        NOT NULL DEFAULT 'dead'
                        CHECK (status IN ('dead', 'replay_requested', 'replayed', 'discarded')),
    replay_requested_at timestamptz,
    replayed_at         timestamptz,
    replay_attempts     integer     NOT NULL DEFAULT 0,
    last_replay_error   text,
    discarded_at        timestamptz,
    discard_reason      text,
    CHECK (cardinality(header_keys) = cardinality(header_values))
);

-- One row per Kafka record and group: a record dead-lettered again (a
-- redelivery after a crash, a failed replay's redelivery) re-opens its row.
-- Rows without a partition (not from Kafka) never conflict.
CREATE UNIQUE INDEX consumer_dead_letters_record_idx
    ON consumer_dead_letters (consumer_group, topic, kafka_partition, kafka_offset);

CREATE INDEX consumer_dead_letters_status_idx ON consumer_dead_letters (consumer_group, status, id);
