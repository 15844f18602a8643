\set id random(1, 1000000000000)
\set agg random(1, 400)
\startpipeline
BEGIN;
WITH dedup AS (
		INSERT INTO pgmin.processed_events (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
		VALUES ('g', :id::text, 'OrderPlaced', 'order', :agg::text, nextval('pgmin.v'), 'applied')
		ON CONFLICT DO NOTHING
		RETURNING 1, aggregate_version AS v
	), adm AS (
		INSERT INTO pgmin.aggregate_versions AS av (consumer_group, aggregate_type, aggregate_id, version)
		SELECT 'g', 'order', :agg::text, v FROM dedup
		ON CONFLICT (consumer_group, aggregate_type, aggregate_id) DO UPDATE
		SET previous_version = av.version,
		    version = CASE WHEN EXCLUDED.version > av.version THEN EXCLUDED.version ELSE av.version END,
		    updated_at = now()
		RETURNING previous_version, version, parked_count
	)
	SELECT a.previous_version, a.version, a.parked_count FROM (SELECT) AS one LEFT JOIN adm a ON true;
\endpipeline
INSERT INTO pgmin.handled (event_id, aggregate_id, amount) VALUES (:id::text, :agg::text, 1234);
COMMIT;
