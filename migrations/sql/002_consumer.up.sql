-- Consumer side: dedup records, per-aggregate versions, parked events and
-- the audit of skipped gaps. Every row is scoped by consumer group.

-- One row per event a consumer group has handled, written in the handler's
-- transaction. outcome says what happened to it.
CREATE TABLE processed_events (
    consumer_group    text        NOT NULL,
    event_id          text        NOT NULL,
    event_type        text        NOT NULL DEFAULT '',
    aggregate_type    text        NOT NULL DEFAULT '',
    aggregate_id      text        NOT NULL DEFAULT '',
    aggregate_version bigint      NOT NULL DEFAULT 0,
    outcome           text        NOT NULL CHECK (outcome IN ('applied', 'stale', 'parked')),
    processed_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, event_id)
);

-- Rows arrive in processed_at order, so a BRIN index serves retention at
-- almost no write cost.
CREATE INDEX processed_events_processed_at_idx ON processed_events USING brin (processed_at);

-- The last applied version of each aggregate, per consumer group. Locked
-- for the duration of each event's transaction. previous_version is the
-- version before the last write (the gate's upsert returns it, so one
-- statement locks, decides and advances); parked_count is the number of
-- this aggregate's rows in parked_events, so the hot path only looks for
-- parked successors when there are some.
CREATE TABLE aggregate_versions (
    consumer_group   text        NOT NULL,
    aggregate_type   text        NOT NULL,
    aggregate_id     text        NOT NULL,
    version          bigint      NOT NULL CHECK (version >= 0),
    previous_version bigint      NOT NULL DEFAULT 0,
    parked_count     integer     NOT NULL DEFAULT 0 CHECK (parked_count >= 0),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, aggregate_type, aggregate_id)
)
-- Every event updates its aggregate's row; free space on each page lets
-- PostgreSQL update in place (HOT) without touching the index.
WITH (fillfactor = 70);

-- Events that arrived ahead of a missing version, waiting for it.
CREATE TABLE parked_events (
    consumer_group    text        NOT NULL,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_id          text        NOT NULL,
    event_type        text        NOT NULL,
    handler           text        NOT NULL DEFAULT '',
    topic             text        NOT NULL DEFAULT '',
    payload           bytea       NOT NULL,
    metadata          jsonb       NOT NULL,
    parked_at         timestamptz NOT NULL DEFAULT now(),
    -- Failed attempts to apply it once its turn came, and the last error.
    release_attempts  integer     NOT NULL DEFAULT 0,
    last_error        text,
    last_attempt_at   timestamptz,
    PRIMARY KEY (consumer_group, aggregate_type, aggregate_id, aggregate_version)
);

CREATE INDEX parked_events_parked_at_idx ON parked_events (consumer_group, parked_at);

-- Audit of versions given up on: the sweeper skipped the gap after the park
-- timeout, or an operator released it.
CREATE TABLE skipped_versions (
    id             bigserial   PRIMARY KEY,
    consumer_group text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    from_version   bigint      NOT NULL,
    to_version     bigint      NOT NULL,
    reason         text        NOT NULL,
    skipped_at     timestamptz NOT NULL DEFAULT now(),
    CHECK (from_version <= to_version)
);

CREATE INDEX skipped_versions_aggregate_idx ON skipped_versions (consumer_group, aggregate_type, aggregate_id);
