DROP TABLE IF EXISTS relay_leases;
DROP TABLE IF EXISTS relay_members;
DROP FUNCTION IF EXISTS notify_outbox() CASCADE;
DROP TABLE IF EXISTS outbox_waiting;
DROP TABLE IF EXISTS relay_failures;
DROP TABLE IF EXISTS aggregate_sequences;
DROP TABLE IF EXISTS outbox_config;
