-- Producer side: outbox configuration, per-aggregate sequences, relay
-- failure bookkeeping and dead letters. The outbox shard tables themselves
-- are created by migrations.Up from watermill-sql's schema adapter.
-- Runs with search_path set to the eventline schema.

CREATE TABLE outbox_config (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    shards     integer NOT NULL CHECK (shards BETWEEN 1 AND 1024),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- The last aggregate version handed out by the producer. Writers of one
-- aggregate serialize on its row.
CREATE TABLE aggregate_sequences (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    version        bigint NOT NULL CHECK (version > 0),
    PRIMARY KEY (aggregate_type, aggregate_id)
)
-- Updated on every publish: leave room for in-place (HOT) updates.
WITH (fillfactor = 70);

-- One row per outbox message the relay failed to publish and will retry.
-- Deleted when the message is delivered or dead-lettered.
CREATE TABLE relay_failures (
    shard           integer     NOT NULL,
    outbox_uuid     text        NOT NULL,
    attempts        integer     NOT NULL,
    last_error      text        NOT NULL,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    next_attempt_at timestamptz NOT NULL,
    PRIMARY KEY (shard, outbox_uuid)
);

-- Messages the relay gave up on. payload and metadata are the outbox row as
-- stored, so a replay re-enqueues exactly the same envelope (same event id,
-- same aggregate version).
CREATE TABLE dead_letters (
    id                bigserial   PRIMARY KEY,
    shard             integer     NOT NULL,
    outbox_uuid       text        NOT NULL,
    event_id          text        NOT NULL DEFAULT '',
    event_type        text        NOT NULL DEFAULT '',
    aggregate_type    text        NOT NULL DEFAULT '',
    aggregate_id      text        NOT NULL DEFAULT '',
    aggregate_version bigint      NOT NULL DEFAULT 0,
    destination_topic text        NOT NULL DEFAULT '',
    payload           json,
    metadata          json,
    attempts          integer     NOT NULL,
    last_error        text        NOT NULL,
    dead_reason       text        NOT NULL,
    dead_at           timestamptz NOT NULL DEFAULT now(),
    replayed_at       timestamptz
);

CREATE INDEX dead_letters_pending_idx ON dead_letters (dead_at) WHERE replayed_at IS NULL;

-- Shards whose relay is idle and waiting for a notification, until
-- expires_at: an idle relay keeps pushing it forward, so the request of a
-- relay that died lapses and producers stop notifying nobody. Unlogged: it
-- is a hint, rebuilt by the relays, and must not cost WAL or fsyncs.
CREATE UNLOGGED TABLE outbox_waiting (
    shard      integer     PRIMARY KEY,
    expires_at timestamptz NOT NULL
);

-- Statement trigger on every outbox shard table (arguments: the NOTIFY
-- payload "<schema>.<shard>", and the shard): wakes the shard's relay if it
-- is waiting. A NOTIFY makes PostgreSQL serialize the commits of the
-- transactions that sent one, so busy relays are not notified at all.
-- The body names outbox_waiting with its schema (filled in below) rather
-- than SET search_path: a SET clause costs every call a configuration
-- save and restore, and the trigger runs on every outbox insert.
DO $create$
BEGIN
    EXECUTE format($fn$
        CREATE FUNCTION notify_outbox() RETURNS trigger
        LANGUAGE plpgsql AS $body$
        BEGIN
            IF EXISTS (SELECT 1 FROM %I.outbox_waiting WHERE shard = TG_ARGV[1]::integer AND expires_at > now()) THEN
                PERFORM pg_notify('eventline_outbox', TG_ARGV[0]);
            END IF;
            RETURN NULL;
        END
        $body$
    $fn$, current_schema());
END
$create$;
