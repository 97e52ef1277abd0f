"""A layer placement: which node runs which contiguous layer range, and what it should achieve.

Saved as plan.yaml, read by ``pipeshard export --plan`` (the split) and by ``pipeshard plan
--topology`` (the stage addresses).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from pipeshard.errors import InvalidArgument

OBJECTIVES = ("latency", "throughput")


@dataclass(frozen=True)
class StagePlan:
    node: str
    address: str
    layer_start: int
    layer_end: int
    step_ms: float  # one step of one micro-batch on this stage, its send included
    tok_s: float  # tokens/s this stage alone could sustain (rows / step time)
    memory_bytes: int  # weights, KV cache and embedding / head it holds
    device: str = "CPU"  # the OpenVINO device its node compiles for (the topology's stage device)

    @property
    def layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class Plan:
    model: str
    num_layers: int
    objective: str
    batch: int  # sequences decoding at once
    micro_batches: int  # groups they travel the pipeline in (rows per step = batch / micro_batches)
    stages: tuple[StagePlan, ...]
    round_ms: float  # time for every sequence to advance one token
    tok_s: float  # predicted end to end
    skipped: tuple[str, ...] = field(default=())

    @property
    def split(self) -> list[int]:
        return [s.layers for s in self.stages]

    @property
    def ranges(self) -> str:
        """The ``--split`` form ``0:12,12:20,20:30``."""
        return ",".join(f"{s.layer_start}:{s.layer_end}" for s in self.stages)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["stages"] = [asdict(s) for s in self.stages]
        out["skipped"] = list(self.skipped)
        out["split"] = self.ranges
        return out

    def save(self, path: Path | str) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load(cls, path: Path | str) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise InvalidArgument("plan", f"no plan file at {path} (write one with `pipeshard plan --out`)")
        try:
            raw = yaml.safe_load(path.read_text())
            raw.pop("split", None)
            stages = tuple(StagePlan(**s) for s in raw.pop("stages"))
            plan = cls(**{**raw, "stages": stages, "skipped": tuple(raw.get("skipped", ()))})
        except (yaml.YAMLError, AttributeError, KeyError, TypeError) as exc:
            raise InvalidArgument("plan", f"{path} is malformed ({exc})") from None
        expected = 0
        for s in plan.stages:
            if s.layer_start != expected or s.layer_end <= s.layer_start:
                raise InvalidArgument("plan", f"{path}: ranges must be contiguous from 0 ({plan.ranges})")
            expected = s.layer_end
        if expected != plan.num_layers or not plan.stages:
            raise InvalidArgument("plan", f"{path}: {plan.ranges} does not cover {plan.num_layers} layers")
        return plan
