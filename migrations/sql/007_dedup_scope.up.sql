-- Dedup records scoped by aggregate. An event id is unique per event, but a
-- consumer cannot tell a genuine event from a record that reuses its id.
-- Keyed by (group, event id, aggregate), an id reused in another aggregate
-- is another event of that aggregate, gated on its own version, and costs
-- the genuine event nothing, whichever arrives (or, in another lane, is
-- recorded) first. Within one aggregate the id still conflicts: a second
-- event under a recorded id is refused (dedup.IDConflictError). Events
-- without an aggregate version still name their aggregate (the envelope
-- requires one) and are scoped by it too.
--
-- The event id comes before the aggregate: ids are UUIDv7 by default, so
-- new rows land at the right edge of the index, and a lookup by id alone
-- (every record of an id in a group) reads a prefix of it.
-- Rebuilding the key locks the table while the index builds.
ALTER TABLE processed_events DROP CONSTRAINT processed_events_pkey,
    ADD PRIMARY KEY (consumer_group, event_id, aggregate_type, aggregate_id);

-- Late events are held per record the same way, so events of two
-- aggregates sharing an id can both be held.
ALTER TABLE late_events DROP CONSTRAINT late_events_pkey,
    ADD PRIMARY KEY (consumer_group, event_id, aggregate_type, aggregate_id);
