"""A real fleet across emulated WAN links: each stage in its own namespace, every hop delayed.

Stage k runs in namespace ``psw-<k>`` on 10.77.<k>.2. One forwarder process in the root
namespace adds the one-way delay on every hop and listens on the root side of each veth:

- 10.77.<k>.1:7000 -> stage k: the coordinator's door (frames into stage 0, control calls, and
  the Results subscription it holds on the final stage, so results come back delayed too);
- 10.77.<k>.1:7001 -> stage k+1: stage k's next hop, so bytes between stages cross two
  tbf-capped veths and one delay.

A token therefore pays N+1 delayed hops on an N-stage ring. The coordinator runs in the root
namespace on 127.0.0.1. Cleanup (processes, then veths and namespaces) runs on ``stop()``, on an
exception while starting, at interpreter exit, and from a watchdog process if the owner is killed
or a detached fleet outlives its TTL.
"""

from __future__ import annotations

import atexit
import itertools
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.launcher import Fleet, coordinator_args, fleet_env, spawn, stage_args
from pipeshard.services.wan import netns, state
from pipeshard.services.wan.netns import Link, WanError

STAGE_PORT = 50061  # each stage's port inside its own namespace
CONTROL_PORT = 7000  # on 10.77.<k>.1: the coordinator's door to stage k
NEXT_HOP_PORT = 7001  # on 10.77.<k>.1: stage k's door to stage k+1


class WanFleet:
    """``WanFleet(shards, stages, delay_ms, rate_mbit, run_dir)``; ``.coordinator`` is the address to
    give ``PipeshardClient``. ``rate_mbit=None`` (or 0) leaves bandwidth uncapped. ``detach``
    (``wan up``) keeps the fleet running after this process exits, until ``wan down`` or ``ttl_s``."""

    def __init__(
        self,
        shards: Path,
        stages: int,
        delay_ms: float,
        rate_mbit: float | None,
        run_dir: Path,
        precision: str = DEFAULT_PRECISION,
        extra_stage_args: Sequence[str] = (),
        extra_coordinator_args: Sequence[str] = (),
        *,
        final_stage_args: Sequence[str] = (),
        coordinator_port: int = 0,
        detach: bool = False,
        ttl_s: float | None = None,
        timeout_s: float = 180.0,
        log_format: str = "json",
    ):
        netns.require_root(bool(rate_mbit))
        self.delay_ms = delay_ms
        self.rate_mbit = rate_mbit or None
        self.run_dir = Path(run_dir).resolve()  # the watchdog may run from anywhere
        self.links = [Link(k) for k in range(stages)]
        self.fleet = Fleet(self.run_dir)
        self._watchdog: subprocess.Popen | None = None
        self._stopped = False
        if state.recorded_namespaces(self.run_dir):
            raise WanError(
                f"a WAN fleet is already up in {self.run_dir} (run `pipeshard wan down --run-dir "
                f"{self.run_dir}`)"
            )
        netns.require_free()
        if not detach:
            atexit.register(self.stop)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # Recorded before anything exists, so every teardown path finds a half-built fleet too.
            names = "".join(f"{link.namespace}\n" for link in self.links)
            (self.run_dir / state.NAMESPACES).write_text(names)
            self._watchdog = self._start_watchdog(detach, ttl_s)
            for link in self.links:
                netns.create(link, self.rate_mbit)
            env = fleet_env()

            def start(name: str, args: list[str], **kwargs) -> None:
                self.fleet.processes.append(
                    spawn(name, args, self.run_dir, env, timeout_s, detach=detach, **kwargs)
                )

            start("forwarder", self._forwarder_args(), module="pipeshard.services.wan.forwarder")
            for link in self.links:
                next_hop = f"{link.root_ip}:{NEXT_HOP_PORT}" if link.index < stages - 1 else None
                # The namespace's private link: plaintext asked for (stages refuse it unasked beyond
                # loopback); pass --tls-dir in extra_stage_args for a secured emulated WAN.
                extra = [*extra_stage_args, "--host", link.ns_ip, "--allow-plaintext"]
                if link.index == stages - 1:  # --draft-heads: the final stage's alone
                    extra += final_stage_args
                args = stage_args(
                    link.index, Path(shards), STAGE_PORT, precision, log_format, next_hop, extra
                )
                start(f"stage{link.index}", args, prefix=link.exec_prefix)
            doors = [f"{link.root_ip}:{CONTROL_PORT}" for link in self.links]
            start(
                "coordinator",
                coordinator_args(doors, Path(shards), coordinator_port, log_format, extra_coordinator_args),
            )
        except BaseException:
            self.stop()
            raise

    @property
    def coordinator(self) -> str:
        return self.fleet.coordinator

    @property
    def emulation(self) -> dict:
        """What produced a figure, for a benchmark's JSON (figures must name their method)."""
        return {
            "method": "wan-emulator: netns + veth tbf + user-space delay forwarder",
            "delay_ms_per_hop": self.delay_ms,
            "rate_mbit": self.rate_mbit,
            "delayed_hops_per_token": len(self.links) + 1,
        }

    def link_fault(self, k: int, kind: str, percent: float = 0.0) -> None:
        """Stage ``k``'s hop to stage k+1 loses ``percent`` of its packets (``loss``), all of them
        (``partition``: the hop stalls without closing) or is reset (``reset``), by nftables in
        stage k's namespace, until :meth:`heal`; the coordinator's door to stage k is untouched."""
        if not 0 <= k < len(self.links) - 1:
            raise ValueError(f"k must name a stage with a next hop (0..{len(self.links) - 2}), got {k}")
        netns.fault(self.links[k], kind, NEXT_HOP_PORT, percent)

    def heal(self, k: int) -> None:
        netns.heal(self.links[k])

    def _start_watchdog(self, detach: bool, ttl_s: float | None) -> subprocess.Popen:
        """Detached: it ends the fleet after ``ttl_s``. Owned: also when this process dies unannounced."""
        args = [sys.executable, "-m", "pipeshard.services.wan.watchdog", str(self.run_dir)]
        args += ["--ttl-s", str(ttl_s)] if ttl_s is not None else []
        args += [] if detach else ["--owner-pid", str(os.getpid())]
        with (self.run_dir / "watchdog.log").open("w") as log:
            popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        (self.run_dir / state.WATCHDOG).write_text(str(popen.pid))
        return popen

    def _forwarder_args(self) -> list[str]:
        routes = [f"{link.root_ip}:{CONTROL_PORT}={link.ns_ip}:{STAGE_PORT}" for link in self.links]
        routes += [
            f"{a.root_ip}:{NEXT_HOP_PORT}={b.ns_ip}:{STAGE_PORT}" for a, b in itertools.pairwise(self.links)
        ]
        return ["--delay-ms", f"{self.delay_ms:g}", *routes]

    def stop(self) -> None:
        """Stops the watchdog, the processes (coordinator first), then deletes veths and namespaces."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        if self._watchdog is not None:
            self._watchdog.terminate()
            self._watchdog.wait()
        self.fleet.stop()
        netns.destroy([link.namespace for link in self.links])
        state.forget(self.run_dir)

    def __enter__(self) -> WanFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
