\set id random(1, 1000000000000)
\set agg random(1, 400)
BEGIN;
INSERT INTO pgmin.handled (event_id, aggregate_id, amount) VALUES (:id::text, :agg::text, 1234);
COMMIT;
