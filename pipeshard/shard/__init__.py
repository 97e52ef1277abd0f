"""The shard runtime shared by the stage service and the local runner."""
