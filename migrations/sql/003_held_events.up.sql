-- Events held for the operator: one table, three kinds, one life.
--
--   relay_dead_letter  an outbox row the relay gave up publishing; in the
--                      producer's database, shard and message_uuid name
--                      its outbox row.
--   dead_letter        a message a consumer group gave up on; in the
--                      consumer's database, kafka_* locate the record.
--   late               an event a consumer group received but can no
--                      longer apply in order: its aggregate passed its
--                      version.
--
-- status: held (waiting for an operator) -> replay_requested (a running
-- consumer of the group replays it: a dead letter through the version
-- gate, a late event applied late, the handler told) -> replayed; or
-- discarded, with a reason. A relay dead letter's replay re-enqueues it
-- into its outbox shard at once (held -> replayed). A replay that fails
-- goes back to held with the error. `eventline held list|replay|discard`
-- (package admin: ListHeld, ReplayHeld, DiscardHeld) works on every kind.
CREATE TABLE held_events (
    id                  bigserial   PRIMARY KEY,
    kind                text        NOT NULL CHECK (kind IN ('relay_dead_letter', 'dead_letter', 'late')),
    -- Why it is held. Dead letters: permanent, retries_exhausted, failed,
    -- id_conflict, gap_too_large or a component's own; the relay's:
    -- rejected, retries_exhausted. Late events: arrived_late (its version
    -- had been given up on), passed (parked, and the aggregate moved past
    -- it), release_failed (parked, and kept failing), version_conflict (a
    -- replayed dead letter whose version another event took meanwhile).
    -- reason says it in full.
    cause               text        NOT NULL,
    reason              text        NOT NULL,
    -- The consumer group holding it; '' for the relay's.
    consumer_group      text        NOT NULL DEFAULT '',
    -- The event, from its envelope when it decodes ('' and 0 when a dead
    -- letter's does not), for listing and replay order. Not indexed for
    -- dead letters: a hostile record may make them arbitrarily long.
    event_id            text        NOT NULL DEFAULT '',
    event_type          text        NOT NULL DEFAULT '',
    aggregate_type      text        NOT NULL DEFAULT '',
    aggregate_id        text        NOT NULL DEFAULT '',
    aggregate_version   bigint      NOT NULL DEFAULT 0,
    previous_version    bigint      NOT NULL DEFAULT 0,
    -- Late events: the aggregate's version when the event was held.
    current_version     bigint      NOT NULL DEFAULT 0,
    -- The topic it came from (consumer kinds) or was bound for (the
    -- relay's), and the handler it was delivered to (a replay runs it
    -- through the same handler).
    topic               text        NOT NULL DEFAULT '',
    handler             text        NOT NULL DEFAULT '',
    -- The message byte for byte (headers are bytea so NUL bytes and
    -- invalid UTF-8 survive): the Watermill message uuid (the outbox row's
    -- for the relay's), payload and headers.
    message_uuid        bytea       NOT NULL,
    payload             bytea       NOT NULL,
    header_keys         bytea[]     NOT NULL,
    header_values       bytea[]     NOT NULL,
    -- Where the Kafka record was, when it came from Kafka.
    kafka_partition     integer,
    kafka_offset        bigint,
    kafka_key           bytea,
    -- The relay's: the outbox shard the row was in and is replayed into.
    shard               integer,
    held_at             timestamptz NOT NULL DEFAULT now(),
    -- A dead letter held again (a redelivered record) re-opens its row.
    times_held          integer     NOT NULL DEFAULT 1,
    status              text        NOT NULL DEFAULT 'held'
                        CHECK (status IN ('held', 'replay_requested', 'replayed', 'discarded')),
    replay_requested_at timestamptz,
    replayed_at         timestamptz,
    -- Failed attempts to deliver it (the relay's publishes and a parked
    -- event's releases before it was held, the replays since the last
    -- request), the last error, and when the consumer may try again.
    attempts            integer     NOT NULL DEFAULT 0,
    last_error          text,
    last_attempt_at     timestamptz,
    next_attempt_at     timestamptz,
    discarded_at        timestamptz,
    discard_reason      text,
    CHECK (cardinality(header_keys) = cardinality(header_values)),
    CHECK ((kind = 'relay_dead_letter') = (shard IS NOT NULL)),
    CHECK ((kind = 'relay_dead_letter') = (consumer_group = ''))
);

-- Open rows by group and kind: the status counts, listing, and the
-- consumer's claim of the rows whose replay was requested (it orders them
-- per aggregate by version; they are few).
CREATE INDEX held_events_open_idx ON held_events (consumer_group, kind, id)
    WHERE status IN ('held', 'replay_requested');

-- One open late row per event of a group: the gate holds a late event with
-- ON CONFLICT DO NOTHING, in the statement that finds it late.
CREATE UNIQUE INDEX held_events_late_key ON held_events (consumer_group, event_id, aggregate_type, aggregate_id)
    WHERE kind = 'late' AND status IN ('held', 'replay_requested');

-- One row per Kafka record and group: a record dead-lettered again (a
-- redelivery after a crash, a failed replay's redelivery) re-opens its row.
-- Rows without a partition (not from Kafka) never conflict.
CREATE UNIQUE INDEX held_events_record_key ON held_events (consumer_group, topic, kafka_partition, kafka_offset)
    WHERE kind = 'dead_letter';
