-- Producer side: outbox configuration, per-aggregate sequences, the relay's
-- failure bookkeeping, its wake-up hint and its leases. The outbox shard
-- tables themselves are created by migrations.Up from watermill-sql's
-- schema adapter. The relay's dead letters are held in held_events
-- (003_held_events).
-- Runs with search_path set to the eventline schema.

CREATE TABLE outbox_config (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    shards     integer NOT NULL CHECK (shards BETWEEN 1 AND 1024),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- The last aggregate version handed out by the producer. Writers of one
-- aggregate serialize on its row. topic is the Kafka topic of the
-- aggregate's first event: the producer refuses events of the aggregate for
-- any other topic, so a consumer group reading the topic sees every version.
CREATE TABLE aggregate_sequences (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    version        bigint NOT NULL CHECK (version > 0),
    topic          text,
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

-- Relay ownership as leases (not session advisory locks, which live as
-- long as PostgreSQL believes the session does: hours after a host
-- vanishes). Every time here is PostgreSQL's clock (clock_timestamp()), so
-- relays on different hosts never compare their own clocks.

-- One row per relay instance (one Relay.Run), renewed every
-- RebalanceInterval together with its leases. Unexpired rows are the live
-- relays a fair share is computed from.
CREATE TABLE relay_members (
    instance    text        PRIMARY KEY,
    relay_id    text        NOT NULL,  -- RelayConfig.ID, for people
    backend_pid integer     NOT NULL,  -- pg_backend_pid() of its ownership connection
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at  timestamptz NOT NULL
);

-- The relay instance that may relay a shard, until expires_at. The owner
-- stops relaying before its lease expires; another relay takes the shard
-- only once expires_at has passed, bumping epoch. A released lease is
-- deleted.
CREATE TABLE relay_leases (
    shard       integer     PRIMARY KEY,
    owner       text        NOT NULL,  -- relay_members.instance
    epoch       bigint      NOT NULL DEFAULT 1,
    acquired_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at  timestamptz NOT NULL
)
-- Renewed in place every RebalanceInterval: leave room for HOT updates.
WITH (fillfactor = 50);

CREATE INDEX relay_leases_owner_idx ON relay_leases (owner);
