"""Runtime services: the shard runtime, the stage service and the coordinator."""
