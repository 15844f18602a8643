-- The PostgreSQL floor of a consumer transaction: what one event costs the
-- database with the statements of a bare handler, of eventline's admission
-- and of cheaper designs, without any Go in the way (pgbench, 16 clients).
-- Run by run.sh; see docs/BENCHMARKS.md, "Cost per event".
SET client_min_messages = warning;
DROP SCHEMA IF EXISTS pgmin CASCADE;
CREATE SCHEMA pgmin;
CREATE SEQUENCE pgmin.v;
CREATE TABLE pgmin.handled (event_id text PRIMARY KEY, aggregate_id text NOT NULL, amount bigint NOT NULL);
CREATE TABLE pgmin.processed_events (
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
CREATE INDEX ON pgmin.processed_events USING brin (processed_at);
CREATE TABLE pgmin.aggregate_versions (
    consumer_group   text        NOT NULL,
    aggregate_type   text        NOT NULL,
    aggregate_id     text        NOT NULL,
    version          bigint      NOT NULL CHECK (version >= 0),
    previous_version bigint      NOT NULL DEFAULT 0,
    parked_count     integer     NOT NULL DEFAULT 0 CHECK (parked_count >= 0),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, aggregate_type, aggregate_id)
) WITH (fillfactor = 70);
-- The one-row design (floor_onerow.sql): the version kept on the dedup
-- row, the aggregate's last version read through an index on it.
CREATE TABLE pgmin.processed_onerow (LIKE pgmin.processed_events INCLUDING ALL);
CREATE UNIQUE INDEX ON pgmin.processed_onerow (consumer_group, aggregate_type, aggregate_id, aggregate_version);
