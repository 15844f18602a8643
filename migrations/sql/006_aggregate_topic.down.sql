ALTER TABLE aggregate_sequences DROP COLUMN IF EXISTS topic;
