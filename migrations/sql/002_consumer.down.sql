DROP TABLE IF EXISTS skipped_versions;
DROP TABLE IF EXISTS parked_events;
DROP TABLE IF EXISTS aggregate_versions;
DROP TABLE IF EXISTS processed_events;
