"""The target's own texts with its features: its greedy answers to its own questions, with the
final normed hidden state and the argmax at every position, read on the way (generated in
batches on the paged backend). Every feature-reading draft kind trains on them, so they are
generated once per target and prompt set and kept in a file.

The questions are the model's own user turns, sampled from its chat template after an opening
word or two (OPENERS). Answers to a few templates over a list of topics were too alike: a draft
trained on them agreed with the target on 46% of their held-out answer positions but on 24% of
natural prompts'. Sampled user turns are as varied as the chat data the model learned from, and
none is a benchmark prompt.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.shard.manifest import load_manifest

Report = Callable[[str, float, str], object]
# The questions answered by default: every feature-reading draft kind trains on the same file.
PROMPTS = 2048
QUESTION_TOKENS = 48  # a sampled user turn is cut here (most end sooner)
QUESTION_TEMPERATURE = 0.9
# How a user turn may start: spread over the requests a chat model gets (questions, code,
# translation, arithmetic, lists, stories, explanations, small talk); "" leaves it all to the model.
OPENERS = (
    "", "", "", "", "", "", "What", "How", "Why", "Can you", "Could you", "Explain", "Describe",
    "Write", "Write a short story", "Write a poem", "Write an email", "List", "Name", "Give me",
    "Tell me", "Summarize", "Compare", "Suggest", "Help me", "I'm", "Hi!", "Hello", "Is it",
    "Should I", "Who", "When", "Where", "Which", "Solve", "Calculate", "If", "Plan", "Create",
    "Translate into French:", "Translate into Spanish:", "Translate into German:",
    "Complete this Python function:\ndef", "Write a Python function", "Fix this code:",
    "What is the difference between",
)  # fmt: skip
# Rows per paged inference: 2048 questions in 5.5 minutes and their 128-token answers in 10.3 on 2
# quiet cores (64 rows: about 200 answers a minute, 32: 90).
BATCH = 128
CACHE_BYTES_PER_ROW = 24 * 1024 * 1024  # f32 KV of SmolLM2-135M: 8 blocks of 32 tokens per row
# The generated texts, kept in a draft's output folder: a rerun (after an interruption, or --force
# with other training settings) trains without generating them again.
TEXTS = "texts.npz"


@dataclass(frozen=True)
class FeatureTexts:
    """Every text's token ids, the target's final normed features and argmax at each position."""

    ids: list[np.ndarray]  # int64 [n]
    features: list[np.ndarray]  # float16 [n, H]: what the final stage returns on the wire
    argmax: list[np.ndarray]  # int64 [n]
    minutes: float = 0.0  # how long generating them took (questions and answers)

    @property
    def positions(self) -> int:
        return sum(len(i) for i in self.ids)

    def answer_start(self, i: int) -> int:
        """Where text ``i``'s answer starts: the position after the last one whose next token the
        target did not choose (the prompt's last, or a few template tokens before it), 0 if it
        chose them all. Drafts run from there on, so that is where they train."""
        off = np.flatnonzero(self.ids[i][1:] != self.argmax[i][:-1])
        return int(off[-1]) + 1 if len(off) else 0

    def split(self, held_out: float, seed: int) -> tuple[FeatureTexts, FeatureTexts]:
        """(held out, training): ``held_out`` of the texts (at least one), picked by a seeded
        shuffle, kept apart from the rest."""
        order = list(range(len(self.ids)))
        random.Random(seed).shuffle(order)
        n_eval = max(1, round(held_out * len(order)))
        if len(order) - n_eval < 1:
            raise InvalidArgument("prompts", f"{len(order)} texts leave nothing to train on")

        def part(index: list[int]) -> FeatureTexts:
            return FeatureTexts(
                *([getattr(self, k)[i] for i in index] for k in ("ids", "features", "argmax"))
            )

        return part(order[:n_eval]), part(order[n_eval:])


Pick = Callable[[np.ndarray], int]  # a row's last logits [V] -> the token it continues with


def sampler(seed: int, temperature: float = 1.0, top_k: int = 50) -> Pick:
    """Seeded top-k sampling at ``temperature``."""
    rng = np.random.default_rng(seed)

    def pick(logits: np.ndarray) -> int:
        top = np.argpartition(logits, -top_k)[-top_k:]
        z = logits[top].astype(np.float64) / temperature
        p = np.exp(z - z.max())
        return int(top[rng.choice(top_k, p=p / p.sum())])

    return pick


def generate_features(
    target_export: Path,
    prompts: Sequence[list[int]],
    max_tokens: int,
    report: Report,
    batch: int = BATCH,
    pick: Pick | None = None,
    phase: str = "generate",
) -> FeatureTexts:
    """The target's greedy answers (at ``exact``, whose tokens do not depend on the rows beside
    them), ``batch`` prompts per paged inference, with every position's feature and argmax read
    on the way: the prompt's from its prefill, each answer token's from its decode step. With
    ``pick`` the answer follows its choices instead (the argmax is still what is recorded)."""
    from pipeshard.shard.paged import PagedRow, PagedShard

    manifest = load_manifest(target_export)
    cache = CACHE_BYTES_PER_ROW * batch
    shards = [PagedShard(target_export, k, "exact", cache_bytes=cache) for k in range(manifest.num_stages)]
    eos = set(manifest.model.eos_token_ids)
    out = FeatureTexts([], [], [])
    for first in range(0, len(prompts), batch):
        group = list(enumerate(prompts[first : first + batch]))
        for i, ids in group:
            for shard in shards:
                shard.open(i, len(ids) + max_tokens)
        feats: dict[int, list[np.ndarray]] = {i: [] for i, _ in group}
        top: dict[int, list[np.ndarray]] = {i: [] for i, _ in group}
        tokens = {i: list(ids) for i, ids in group}
        rows = [PagedRow(i, np.asarray(ids), np.arange(len(ids)), logits=len(ids)) for i, ids in group]
        for _ in range(max_tokens):
            for shard in shards[:-1]:
                hidden = shard.step(rows)
                rows = [PagedRow(r.seq, h, r.positions, r.logits) for r, h in zip(rows, hidden, strict=True)]
            logits, features = shards[-1].step_features(rows)
            nxt = []
            for r, lg, f in zip(rows, logits, features, strict=True):
                feats[r.seq].append(f.astype(np.float16))
                top[r.seq].append(lg.argmax(-1).astype(np.int64))
                token = int(top[r.seq][-1][-1]) if pick is None else pick(lg[-1])
                if token in eos:
                    continue
                tokens[r.seq].append(token)
                position = len(tokens[r.seq]) - 1
                nxt.append(PagedRow(r.seq, np.asarray([token]), np.asarray([position]), logits=1))
            rows = nxt
            if not rows:
                break
        for i, _ in group:
            for shard in shards:
                shard.free(i)
            n = sum(len(f) for f in feats[i])  # positions read: the last token was never fed
            out.ids.append(np.asarray(tokens[i][:n], dtype=np.int64))
            out.features.append(np.concatenate(feats[i]))
            out.argmax.append(np.concatenate(top[i]))
        done = min(first + batch, len(prompts))
        report(phase, done / len(prompts), f"{done}/{len(prompts)} {phase} texts with their features")
    return out


def own_questions(target_export: Path, n: int, seed: int, report: Report, batch: int = BATCH) -> list[str]:
    """``n`` distinct user turns the target writes itself: its chat template up to a user turn,
    one of OPENERS, then sampled until the turn ends or QUESTION_TOKENS are written."""
    from pipeshard.shard.prompting import Prompter

    tokenizer = Prompter.from_dir(target_export).tokenizer
    mark = "\x00"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    head = chat[: chat.index(mark)]
    rng = random.Random(seed)
    questions: dict[str, None] = {}  # insertion-ordered set
    for round_ in range(4):
        if len(questions) >= n:
            break
        openers = [rng.choice(OPENERS) for _ in range(round(1.25 * (n - len(questions))) + 8)]
        prefixes = [list(tokenizer.encode(head + o, add_special_tokens=False)) for o in openers]
        pick = sampler(seed + round_, QUESTION_TEMPERATURE)
        data = generate_features(target_export, prefixes, QUESTION_TOKENS, report, batch, pick, "question")
        for opener, prefix, ids in zip(openers, prefixes, data.ids, strict=True):
            turn = ids[len(prefix) :]
            text = (opener + tokenizer.decode(turn, skip_special_tokens=True)).strip()
            if len(text) >= 8:
                questions.setdefault(text)
    if len(questions) < n:
        raise InvalidArgument("prompts", f"the target wrote {len(questions)} distinct questions, not {n}")
    return list(questions)[:n]


def token_counts(data: FeatureTexts, vocab_size: int) -> np.ndarray:
    """How often each token id is the target's argmax in ``data``: which head rows a slice keeps."""
    return np.bincount(np.concatenate(data.argmax), minlength=vocab_size)


def texts_key(fingerprint: str, prompts: int, max_tokens: int, seed: int) -> str:
    """What generated a texts file: the weights, the question count and seed, the length."""
    return f"{fingerprint} own-questions={prompts} max_tokens={max_tokens} seed={seed}"


def target_texts(
    target_export: Path,
    path: Path,
    *,
    prompts: int,
    max_tokens: int,
    seed: int,
    report: Report,
    batch: int = BATCH,
) -> tuple[FeatureTexts, bool]:
    """(texts, reused): the texts kept at ``path`` when this target's weights generated them
    (as many of its own questions, the same seed and length), else generated now and kept there
    (the file may be shared by every draft kind and split of the same weights)."""
    from pipeshard.shard.prompting import Prompter

    key = texts_key(load_manifest(target_export).model.fingerprint, prompts, max_tokens, seed)
    data = load_texts(path, key)
    if data is not None:
        report("generate", 1.0, f"reused {len(data.ids)} texts from {path}")
        return data, True
    prompter = Prompter.from_dir(target_export)
    started = time.perf_counter()
    questions = own_questions(target_export, prompts, seed, report, batch)
    encoded = [prompter.encode("", [("user", q)]) for q in questions]
    data = generate_features(target_export, encoded, max_tokens, report, batch, phase="answer")
    data = dataclasses.replace(data, minutes=(time.perf_counter() - started) / 60.0)
    save_texts(path, key, data)
    return data, False


def save_texts(path: Path, key: str, data: FeatureTexts) -> None:
    """``data`` under ``key`` (what generated it), so a later run with the same key reuses it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npz")
    np.savez(
        partial,
        key=np.asarray(key),
        lengths=np.asarray([len(i) for i in data.ids], dtype=np.int64),
        ids=np.concatenate(data.ids),
        features=np.concatenate(data.features).astype(np.float16),
        argmax=np.concatenate(data.argmax),
        minutes=np.asarray(data.minutes),
    )
    partial.replace(path)


def load_texts(path: Path, key: str) -> FeatureTexts | None:
    """The texts saved at ``path`` if they were generated under ``key``, else None."""
    if not path.is_file():
        return None
    with np.load(path) as saved:
        if str(saved["key"]) != key:
            return None
        cuts = np.cumsum(saved["lengths"])[:-1]
        parts = (list(np.split(saved[name], cuts)) for name in ("ids", "features", "argmax"))
        return FeatureTexts(*parts, minutes=float(saved["minutes"]) if "minutes" in saved else 0.0)
