"""The weight publisher: turns trainer weights into sharded, delta-encoded versions on the bus."""
