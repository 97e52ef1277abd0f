"""A real scaffold server process for the shutdown test: ``python scaffold_server.py --port 0 ...``.

Prints ``scaffold listening on HOST:PORT`` once serving and ``GetStageInfo started`` whenever that
call begins (it then sleeps ``--info-delay`` seconds).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from scaffold_servicer import ScaffoldStage

from pipeshard.grpc_server import run_server
from pipeshard.settings import ServerSettings, load_settings, setting
from pipeshard.v1 import stage_pb2_grpc


@dataclass
class ScaffoldSettings(ServerSettings):
    info_delay: float = setting(1.5, "seconds GetStageInfo sleeps")


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(ScaffoldSettings, argv, prog="scaffold-server")

    def announce() -> None:
        print("GetStageInfo started", flush=True)

    servicer = ScaffoldStage(info_delay=settings.info_delay, on_info=announce)
    return run_server(
        settings, [(stage_pb2_grpc.add_StageServiceServicer_to_server, servicer)], name="scaffold"
    )


if __name__ == "__main__":
    sys.exit(main())
