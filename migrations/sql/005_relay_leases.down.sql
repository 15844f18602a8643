DROP TABLE IF EXISTS relay_leases;
DROP TABLE IF EXISTS relay_members;
