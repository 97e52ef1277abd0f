"""pipeshard: pipeline-parallel LLM serving over pre-compiled OpenVINO shards.

Shared runtime pieces live here (tensor codec, errors, settings, logging, server bootstrap);
the generated protobuf modules live in ``pipeshard.v1`` (built by ``make proto``).
"""

__version__ = "0.1.0"
