\set id random(1, 1000000000000)
\set agg random(1, 400)
\startpipeline
BEGIN;
SELECT coalesce(max(aggregate_version), 0) FROM pgmin.processed_onerow WHERE consumer_group = 'g' AND aggregate_type = 'order' AND aggregate_id = :agg::text;
INSERT INTO pgmin.processed_onerow (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome) VALUES ('g', :id::text, 'OrderPlaced', 'order', :agg::text, nextval('pgmin.v'), 'applied') ON CONFLICT DO NOTHING;
\endpipeline
INSERT INTO pgmin.handled (event_id, aggregate_id, amount) VALUES (:id::text, :agg::text, 1234);
COMMIT;
