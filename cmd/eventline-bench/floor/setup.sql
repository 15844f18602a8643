-- The PostgreSQL floor of a consumer transaction: what one event costs the
-- database with the statements of a bare handler, of eventline's admission
-- and of cheaper designs, without any Go in the way (pgbench, 16 clients).
-- Run by run.sh; see docs/BENCHMARKS.md, "Cost per event".
SET client_min_messages = warning;
DROP SCHEMA IF EXISTS pgmin CASCADE;
CREATE SCHEMA pgmin;
-- eventline's consumer tables, from the migration itself.
SET search_path TO pgmin;
\ir ../../../migrations/sql/002_consumer.up.sql
RESET search_path;
CREATE SEQUENCE pgmin.v;
CREATE TABLE pgmin.handled (event_id text PRIMARY KEY, aggregate_id text NOT NULL, amount bigint NOT NULL);
-- The one-row design (onerow.sql): the version kept on the dedup row, the
-- aggregate's last version read through a unique index on it.
CREATE TABLE pgmin.processed_onerow (LIKE pgmin.processed_events INCLUDING ALL);
CREATE UNIQUE INDEX ON pgmin.processed_onerow (consumer_group, aggregate_type, aggregate_id, aggregate_version);
