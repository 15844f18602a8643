-- Relay ownership as leases (instead of session advisory locks, which live
-- as long as PostgreSQL believes the session does: hours after a host
-- vanishes). Every time here is PostgreSQL's clock (clock_timestamp()), so
-- relays on different hosts never compare their own clocks.
-- Runs with search_path set to the eventline schema.

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
