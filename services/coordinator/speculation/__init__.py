"""Speculative decoding on the coordinator: draft sources, acceptance rules and the K policy."""
