"""Client side of the persistent streams between hops."""
