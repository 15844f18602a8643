-- Consumer side: dedup records, per-aggregate versions, parked events and
-- the audit of skipped gaps. Every row is scoped by consumer group.

-- One row per event a consumer group has handled, written in the handler's
-- transaction. outcome says what happened to it: applied; stale (its
-- version was already applied); parked (waiting for a missing version);
-- late (held in held_events: its version was given up on or passed),
-- late_applied (applied after later versions, the handler told so),
-- late_discarded (the operator discarded it).
--
-- Keyed by (group, event id, aggregate). An event id is unique per event,
-- but a consumer cannot tell a genuine event from a record that reuses its
-- id: keyed by aggregate, an id reused in another aggregate is another
-- event of that aggregate, gated on its own version, and costs the genuine
-- event nothing, whichever arrives first. Within one aggregate the id still
-- conflicts: a second event under a recorded id is refused
-- (dedup.IDConflictError). The event id comes before the aggregate: ids
-- are UUIDv7 by default, so new rows land at the right edge of the index,
-- and a lookup by id alone (every record of an id in a group) reads a
-- prefix of it.
CREATE TABLE processed_events (
    consumer_group    text        NOT NULL,
    event_id          text        NOT NULL,
    event_type        text        NOT NULL DEFAULT '',
    aggregate_type    text        NOT NULL DEFAULT '',
    aggregate_id      text        NOT NULL DEFAULT '',
    aggregate_version bigint      NOT NULL DEFAULT 0,
    outcome           text        NOT NULL
                      CHECK (outcome IN ('applied', 'stale', 'parked', 'late', 'late_applied', 'late_discarded')),
    processed_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, event_id, aggregate_type, aggregate_id)
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
-- previous_version is the version the event follows
-- (aggregate_previous_version on the wire, else aggregate_version - 1): it
-- is applied once its aggregate is at that version or past it.
CREATE TABLE parked_events (
    consumer_group    text        NOT NULL,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    previous_version  bigint      NOT NULL,
    event_id          text        NOT NULL,
    event_type        text        NOT NULL,
    handler           text        NOT NULL DEFAULT '',
    topic             text        NOT NULL DEFAULT '',
    payload           bytea       NOT NULL,
    metadata          jsonb       NOT NULL,
    parked_at         timestamptz NOT NULL DEFAULT now(),
    -- Failed attempts to apply it once its turn came, and the last error.
    -- After a failure the sweeper tries the event again no sooner than
    -- next_attempt_at (exponential backoff), so wedged aggregates cannot
    -- starve the others.
    release_attempts  integer     NOT NULL DEFAULT 0,
    last_error        text,
    last_attempt_at   timestamptz,
    next_attempt_at   timestamptz,
    PRIMARY KEY (consumer_group, aggregate_type, aggregate_id, aggregate_version),
    CHECK (previous_version >= 0 AND previous_version < aggregate_version)
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
