"""Clients of the coordinator: the Python library (sync and asyncio) and the `pipeshard generate` CLI."""
