DROP TABLE IF EXISTS consumer_dead_letters;
