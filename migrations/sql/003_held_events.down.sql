DROP TABLE IF EXISTS held_events;
