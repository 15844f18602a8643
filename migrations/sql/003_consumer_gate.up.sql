-- The version gate's second wave: the predecessor rule, bounded release
-- attempts, events held for the operator because they arrived late.

-- The version each parked event follows (aggregate_previous_version on the
-- wire, else aggregate_version - 1): it is applied once its aggregate is at
-- that version or past it.
ALTER TABLE parked_events ADD COLUMN previous_version bigint;
UPDATE parked_events SET previous_version = aggregate_version - 1;
ALTER TABLE parked_events ALTER COLUMN previous_version SET NOT NULL;
ALTER TABLE parked_events ADD CONSTRAINT parked_events_previous_version_check
    CHECK (previous_version >= 0 AND previous_version < aggregate_version);
-- After a failed release, the sweeper tries the event again no sooner than
-- this (exponential backoff), so wedged aggregates cannot starve the others.
ALTER TABLE parked_events ADD COLUMN next_attempt_at timestamptz;

-- New outcomes: late (held in late_events for the operator), late_applied
-- (applied after later versions, the handler told so), late_discarded (the
-- operator discarded it).
ALTER TABLE processed_events DROP CONSTRAINT processed_events_outcome_check;
ALTER TABLE processed_events ADD CONSTRAINT processed_events_outcome_check
    CHECK (outcome IN ('applied', 'stale', 'parked', 'late', 'late_applied', 'late_discarded'));

-- Events received but never applied whose version the aggregate has
-- passed: they arrived after their version was given up on (kind
-- arrived_late: the version is in skipped_versions), they were parked and
-- the aggregate passed their version without them (kind passed), or they
-- were parked and could not be applied within the release-attempt limit
-- (kind release_failed: their version is then recorded as skipped). They
-- can no longer be applied in order; an operator applies them late (the
-- handler is told) or discards them.
CREATE TABLE late_events (
    consumer_group     text        NOT NULL,
    event_id           text        NOT NULL,
    aggregate_type     text        NOT NULL,
    aggregate_id       text        NOT NULL,
    aggregate_version  bigint      NOT NULL,
    previous_version   bigint      NOT NULL,
    event_type         text        NOT NULL,
    handler            text        NOT NULL DEFAULT '',
    topic              text        NOT NULL DEFAULT '',
    payload            bytea       NOT NULL,
    metadata           jsonb       NOT NULL,
    kind               text        NOT NULL CHECK (kind IN ('arrived_late', 'passed', 'release_failed')),
    -- Why: the skipped_versions reason, or the last release error.
    reason             text        NOT NULL,
    -- The aggregate's version when the event was held.
    current_version    bigint      NOT NULL,
    held_at            timestamptz NOT NULL DEFAULT now(),
    -- Set by `eventline parked apply-late`: the consumer's sweeper applies
    -- the event on its next pass.
    apply_requested_at timestamptz,
    attempts           integer     NOT NULL DEFAULT 0,
    last_error         text,
    last_attempt_at    timestamptz,
    next_attempt_at    timestamptz,
    PRIMARY KEY (consumer_group, event_id)
);

CREATE INDEX late_events_aggregate_idx ON late_events (consumer_group, aggregate_type, aggregate_id, aggregate_version);
CREATE INDEX late_events_apply_idx ON late_events (consumer_group, apply_requested_at) WHERE apply_requested_at IS NOT NULL;
