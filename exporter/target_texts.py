"""The target's own texts with its features: its answers to its own questions, with the final
normed hidden state, the argmax and the top SOFT_K probabilities at every position, read on the
way (generated in batches on the paged backend). Every feature-reading draft kind trains on them,
so they are generated once per target and prompt set and kept in a file.

The texts are of four kinds (TEXT_KINDS), so a draft sees more than one register of the target:
greedy answers (half of the questions), sampled answers (a quarter, at ANSWER_TEMPERATURE),
two-turn chats (a quarter: a greedy exchange, then another of its questions, answered greedily)
and the questions themselves (sampled user turns, read on the way when they are written).

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
ANSWER_TEMPERATURE = 0.8  # the sampled answers: how a sampling request's text reads
SOFT_K = 8  # the target's top probabilities kept at every position (soft targets)
# What each text is, by index: which questions get which kind of answer is the question's index
# modulo 4 (0 and 2 greedy, 1 sampled, 3 a second turn after 2's exchange).
TEXT_KINDS = ("greedy", "sampled", "chat", "question")
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
    # Where each text's generated part starts (see answer_start); None: every text is greedy.
    starts: list[int] | None = None
    soft_ids: list[np.ndarray] | None = None  # int32 [n, SOFT_K]: the target's top tokens
    soft_probs: list[np.ndarray] | None = None  # float16 [n, SOFT_K]: their probabilities
    kinds: list[int] | None = None  # each text's index in TEXT_KINDS

    PER_TEXT = ("ids", "features", "argmax", "starts", "soft_ids", "soft_probs", "kinds")

    @property
    def positions(self) -> int:
        return sum(len(i) for i in self.ids)

    @property
    def soft(self) -> bool:
        return self.soft_ids is not None

    def answer_start(self, i: int) -> int:
        """Where text ``i``'s answer starts: the position after the last one whose next token the
        target did not choose (the prompt's last, or a few template tokens before it), 0 if it
        chose them all. Drafts run from there on, so that is where they train. A sampled text's
        own tokens are not all the target's choice, so its start is kept when it is written."""
        if self.starts is not None:
            return self.starts[i]
        return first_generated(self.ids[i], self.argmax[i])

    def of_kind(self, kind: str) -> FeatureTexts:
        """The texts of one of TEXT_KINDS (all of them when the kinds were not recorded and the
        kind is greedy: such a file holds greedy answers only)."""
        if self.kinds is None:
            return self if kind == "greedy" else self.pick([])
        code = TEXT_KINDS.index(kind)
        return self.pick([i for i, k in enumerate(self.kinds) if k == code])

    def pick(self, index: Sequence[int]) -> FeatureTexts:
        """The texts at ``index``, every per-text field with them."""
        parts = {
            k: None if getattr(self, k) is None else [getattr(self, k)[i] for i in index]
            for k in self.PER_TEXT
        }
        return FeatureTexts(**parts, minutes=self.minutes)  # type: ignore[arg-type]

    def split(self, held_out: float, seed: int) -> tuple[FeatureTexts, FeatureTexts]:
        """(held out, training): ``held_out`` of the texts (at least one), picked by a seeded
        shuffle, kept apart from the rest."""
        order = list(range(len(self.ids)))
        random.Random(seed).shuffle(order)
        n_eval = max(1, round(held_out * len(order)))
        if len(order) - n_eval < 1:
            raise InvalidArgument("prompts", f"{len(order)} texts leave nothing to train on")

        return self.pick(order[:n_eval]), self.pick(order[n_eval:])


def first_generated(ids: np.ndarray, argmax: np.ndarray) -> int:
    """The position after the last one whose next token in ``ids`` is not the target's argmax,
    0 if every one is."""
    off = np.flatnonzero(ids[1:] != argmax[: len(ids) - 1])
    return int(off[-1]) + 1 if len(off) else 0


def join(parts: Sequence[FeatureTexts], minutes: float = 0.0) -> FeatureTexts:
    """``parts`` as one set of texts, in order (each part with every optional field)."""
    fields = {k: [x for p in parts for x in getattr(p, k)] for k in FeatureTexts.PER_TEXT}
    return FeatureTexts(**fields, minutes=minutes)


def soft_targets(logits: np.ndarray, k: int = SOFT_K) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n, k], probabilities float16 [n, k]) of the top ``k`` of each row's softmax,
    most likely first."""
    top = np.argpartition(logits, -k, axis=-1)[:, -k:]
    z = np.take_along_axis(logits, top, -1).astype(np.float64)
    m = logits.max(-1, keepdims=True).astype(np.float64)
    norm = np.log(np.exp(logits.astype(np.float64) - m).sum(-1, keepdims=True))
    p = np.exp(z - m - norm)
    order = np.argsort(-p, axis=-1)
    return (
        np.take_along_axis(top, order, -1).astype(np.int32),
        np.take_along_axis(p, order, -1).astype(np.float16),
    )


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
    kind: str = "greedy",
    row_bytes: int = CACHE_BYTES_PER_ROW,
) -> FeatureTexts:
    """The target's greedy answers (at ``exact``, whose tokens do not depend on the rows beside
    them), ``batch`` prompts per paged inference, with every position's feature, argmax and top
    SOFT_K probabilities read on the way: the prompt's from its prefill, each answer token's from
    its decode step. With ``pick`` the answer follows its choices instead (the argmax is still
    what is recorded). Every text is recorded as ``kind`` (one of TEXT_KINDS); ``row_bytes`` of
    KV cache a row holds its prompt and answer."""
    from pipeshard.shard.paged import PagedRow, PagedShard

    manifest = load_manifest(target_export)
    cache = row_bytes * batch
    shards = [PagedShard(target_export, k, "exact", cache_bytes=cache) for k in range(manifest.num_stages)]
    eos = set(manifest.model.eos_token_ids)
    out = FeatureTexts([], [], [], starts=[], soft_ids=[], soft_probs=[], kinds=[])
    for first in range(0, len(prompts), batch):
        group = list(enumerate(prompts[first : first + batch]))
        for i, ids in group:
            for shard in shards:
                shard.open(i, len(ids) + max_tokens)
        feats: dict[int, list[np.ndarray]] = {i: [] for i, _ in group}
        top: dict[int, list[np.ndarray]] = {i: [] for i, _ in group}
        soft: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {i: [] for i, _ in group}
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
                soft[r.seq].append(soft_targets(lg))
                token = int(top[r.seq][-1][-1]) if pick is None else pick(lg[-1])
                if token in eos:
                    continue
                tokens[r.seq].append(token)
                position = len(tokens[r.seq]) - 1
                nxt.append(PagedRow(r.seq, np.asarray([token]), np.asarray([position]), logits=1))
            rows = nxt
            if not rows:
                break
        for i, prompt in group:
            for shard in shards:
                shard.free(i)
            n = sum(len(f) for f in feats[i])  # positions read: the last token was never fed
            ids = np.asarray(tokens[i][:n], dtype=np.int64)
            argmax = np.concatenate(top[i])
            out.ids.append(ids)
            out.features.append(np.concatenate(feats[i]))
            out.argmax.append(argmax)
            # The prompt's part as answer_start reads a greedy text: what follows is generated.
            out.starts.append(first_generated(ids[: len(prompt)], argmax[: len(prompt)]))  # type: ignore[union-attr]
            out.soft_ids.append(np.concatenate([a for a, _ in soft[i]]))  # type: ignore[union-attr]
            out.soft_probs.append(np.concatenate([b for _, b in soft[i]]))  # type: ignore[union-attr]
            out.kinds.append(TEXT_KINDS.index(kind))  # type: ignore[union-attr]
        done = min(first + batch, len(prompts))
        report(phase, done / len(prompts), f"{done}/{len(prompts)} {phase} texts with their features")
    return out


def own_questions(target_export: Path, n: int, seed: int, report: Report, batch: int = BATCH) -> list[str]:
    """``n`` distinct user turns the target writes itself (question_texts)."""
    return question_texts(target_export, n, seed, report, batch)[0]


def question_texts(
    target_export: Path, n: int, seed: int, report: Report, batch: int = BATCH
) -> tuple[list[str], FeatureTexts]:
    """(``n`` distinct user turns the target writes itself, the texts that wrote them with their
    features): its chat template up to a user turn, one of OPENERS, then sampled until the turn
    ends or QUESTION_TOKENS are written."""
    from pipeshard.shard.prompting import Prompter

    tokenizer = Prompter.from_dir(target_export).tokenizer
    mark = "\x00"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    head = chat[: chat.index(mark)]
    rng = random.Random(seed)
    questions: dict[str, FeatureTexts] = {}  # insertion-ordered: each question's own text
    for round_ in range(4):
        if len(questions) >= n:
            break
        openers = [rng.choice(OPENERS) for _ in range(round(1.25 * (n - len(questions))) + 8)]
        prefixes = [list(tokenizer.encode(head + o, add_special_tokens=False)) for o in openers]
        pick = sampler(seed + round_, QUESTION_TEMPERATURE)
        data = generate_features(
            target_export, prefixes, QUESTION_TOKENS, report, batch, pick, "question", kind="question"
        )
        for i, (opener, prefix, ids) in enumerate(zip(openers, prefixes, data.ids, strict=True)):
            turn = ids[len(prefix) :]
            text = (opener + tokenizer.decode(turn, skip_special_tokens=True)).strip()
            if len(text) >= 8 and text not in questions:
                questions[text] = data.pick([i])
    if len(questions) < n:
        raise InvalidArgument("prompts", f"the target wrote {len(questions)} distinct questions, not {n}")
    chosen = list(questions)[:n]
    return chosen, join([questions[q] for q in chosen])


def token_counts(data: FeatureTexts, vocab_size: int) -> np.ndarray:
    """How often each token id is the target's argmax in ``data``: which head rows a slice keeps."""
    return np.bincount(np.concatenate(data.argmax), minlength=vocab_size)


def texts_key(fingerprint: str, prompts: int, max_tokens: int, seed: int) -> str:
    """What generated a texts file: the weights, the question count and seed, the length, the mix."""
    mix = ",".join(TEXT_KINDS)
    return (
        f"{fingerprint} own-questions={prompts} max_tokens={max_tokens} seed={seed} "
        f"kinds={mix} answer_temperature={ANSWER_TEMPERATURE} soft={SOFT_K}"
    )


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
    (as many of its own questions, the same seed, length and mix), else generated now and kept
    there (the file may be shared by every draft kind and split of the same weights)."""
    key = texts_key(load_manifest(target_export).model.fingerprint, prompts, max_tokens, seed)
    data = load_texts(path, key)
    if data is not None:
        report("generate", 1.0, f"reused {len(data.ids)} texts from {path}")
        return data, True
    started = time.perf_counter()
    data = mixed_texts(target_export, prompts, max_tokens, seed, report, batch)
    data = dataclasses.replace(data, minutes=(time.perf_counter() - started) / 60.0)
    save_texts(path, key, data)
    return data, False


def mixed_texts(
    target_export: Path, prompts: int, max_tokens: int, seed: int, report: Report, batch: int = BATCH
) -> FeatureTexts:
    """The target's ``prompts`` own questions and its answers to them, of every kind in
    TEXT_KINDS: question i is answered greedily when i % 4 is 0 or 2, sampled when 1, and when 3
    it is the second user turn of a chat whose first exchange is question i - 1's."""
    from pipeshard.shard.prompting import Prompter

    prompter = Prompter.from_dir(target_export)
    questions, asked = question_texts(target_export, prompts, seed, report, batch)
    encoded = [prompter.encode("", [("user", q)]) for q in questions]
    greedy = [i for i in range(prompts) if i % 4 in (0, 2)]
    sampled = [i for i in range(prompts) if i % 4 == 1]
    answers = generate_features(
        target_export, [encoded[i] for i in greedy], max_tokens, report, batch, phase="answer"
    )
    pick = sampler(seed + 100, ANSWER_TEMPERATURE)
    drawn = generate_features(
        target_export, [encoded[i] for i in sampled], max_tokens, report, batch, pick, "sampled", "sampled"
    )
    said = {
        i: prompter.tokenizer.decode(ids[len(encoded[i]) :], skip_special_tokens=True).strip()
        for i, ids in zip(greedy, answers.ids, strict=True)
    }
    chats = [
        prompter.encode("", [("user", questions[i - 1]), ("assistant", said[i - 1]), ("user", questions[i])])
        for i in range(prompts)
        if i % 4 == 3 and said.get(i - 1)
    ]
    # A chat's prompt holds a whole exchange before its question: twice the KV a row, half the rows.
    second = generate_features(
        target_export,
        chats,
        max_tokens,
        report,
        max(1, batch // 2),
        None,
        "chat",
        "chat",
        row_bytes=2 * CACHE_BYTES_PER_ROW,
    )
    return join([answers, drawn, second, asked])


def save_texts(path: Path, key: str, data: FeatureTexts) -> None:
    """``data`` under ``key`` (what generated it), so a later run with the same key reuses it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npz")
    extra: dict[str, np.ndarray] = {}
    if data.starts is not None:
        extra["starts"] = np.asarray(data.starts, dtype=np.int64)
    if data.kinds is not None:
        extra["kinds"] = np.asarray(data.kinds, dtype=np.int64)
    if data.soft_ids is not None and data.soft_probs is not None:
        extra["soft_ids"] = np.concatenate(data.soft_ids).astype(np.int32)
        extra["soft_probs"] = np.concatenate(data.soft_probs).astype(np.float16)
    np.savez(
        partial,
        key=np.asarray(key),
        lengths=np.asarray([len(i) for i in data.ids], dtype=np.int64),
        ids=np.concatenate(data.ids),
        features=np.concatenate(data.features).astype(np.float16),
        argmax=np.concatenate(data.argmax),
        minutes=np.asarray(data.minutes),
        **extra,
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

        def split(name: str) -> list[np.ndarray] | None:
            return list(np.split(saved[name], cuts)) if name in saved else None

        return FeatureTexts(
            *(split(name) or [] for name in ("ids", "features", "argmax")),
            minutes=float(saved["minutes"]) if "minutes" in saved else 0.0,
            starts=[int(x) for x in saved["starts"]] if "starts" in saved else None,
            soft_ids=split("soft_ids"),
            soft_probs=split("soft_probs"),
            kinds=[int(x) for x in saved["kinds"]] if "kinds" in saved else None,
        )
