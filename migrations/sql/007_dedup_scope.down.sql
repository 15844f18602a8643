-- Back to one record per event id and group. Refused while a group has
-- recorded (or holds late) one id in more than one aggregate: the old key
-- cannot hold both, and dropping either would forget an event the group
-- saw.
DO $$
DECLARE
    n bigint;
BEGIN
    SELECT count(*) INTO n FROM (SELECT 1 FROM processed_events GROUP BY consumer_group, event_id HAVING count(*) > 1) d;
    IF n > 0 THEN
        RAISE EXCEPTION 'cannot roll back 007_dedup_scope: processed_events records % event id(s) in more than one aggregate of a group, which the old key (consumer_group, event_id) cannot hold', n
            USING HINT = 'SELECT consumer_group, event_id, aggregate_type, aggregate_id, outcome FROM processed_events WHERE (consumer_group, event_id) IN (SELECT consumer_group, event_id FROM processed_events GROUP BY 1, 2 HAVING count(*) > 1); delete the records you can forget first';
    END IF;
    SELECT count(*) INTO n FROM (SELECT 1 FROM late_events GROUP BY consumer_group, event_id HAVING count(*) > 1) d;
    IF n > 0 THEN
        RAISE EXCEPTION 'cannot roll back 007_dedup_scope: late_events holds % event id(s) in more than one aggregate of a group', n
            USING HINT = 'apply or discard them first (eventline parked late)';
    END IF;
END $$;

ALTER TABLE late_events DROP CONSTRAINT late_events_pkey,
    ADD PRIMARY KEY (consumer_group, event_id);
ALTER TABLE processed_events DROP CONSTRAINT processed_events_pkey,
    ADD PRIMARY KEY (consumer_group, event_id);
