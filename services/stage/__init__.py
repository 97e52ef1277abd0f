"""StageService: one shard of consecutive layers with per-session KV state."""
