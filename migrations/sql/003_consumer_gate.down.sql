DROP TABLE IF EXISTS late_events;

UPDATE processed_events SET outcome = 'applied' WHERE outcome = 'late_applied';
UPDATE processed_events SET outcome = 'stale' WHERE outcome IN ('late', 'late_discarded');
ALTER TABLE processed_events DROP CONSTRAINT processed_events_outcome_check;
ALTER TABLE processed_events ADD CONSTRAINT processed_events_outcome_check
    CHECK (outcome IN ('applied', 'stale', 'parked'));

ALTER TABLE parked_events DROP COLUMN IF EXISTS next_attempt_at;
ALTER TABLE parked_events DROP COLUMN IF EXISTS previous_version;
