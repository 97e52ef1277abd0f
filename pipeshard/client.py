"""The public Python client (docs/CLIENTS.md): ``from pipeshard.client import PipeshardClient``.

The code lives in clients/client.py (installed as ``pipeshard.clients.client``); this name is the
stable one users import.
"""

from pipeshard.clients.client import AsyncPipeshardClient, GenerateResult, PipeshardClient

__all__ = ["AsyncPipeshardClient", "GenerateResult", "PipeshardClient"]
