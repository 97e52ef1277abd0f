"""Distil a draft from the target: its first k layers, final norm and an untied LM head over a
vocabulary slice, trained to predict the target's own next token.

A prefix of the target's layers read through the target's head barely agrees with the target
(SmolLM2-135M: 3.5% of tokens at k = 2): the head expects the last layer's features. Training the k
layers, the norm and the head rows on the target's argmax (teacher-forced over texts the target
wrote) removes that mismatch while the draft keeps its size and cost. The result is a Hugging Face
folder (``--speculative DIR``) and its one-stage export with the same vocabulary slice
(``--self-draft``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.exporter.draft import DraftPlan, plan_draft
from pipeshard.exporter.export import TOKENIZER_FILES, ExportResult, export_model
from pipeshard.exporter.truncate import truncate_model

Report = Callable[[str, float, str], object]  # (phase, fraction, message)

_TEMPLATES = (
    "Explain {t} to a beginner.",
    "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?",
    "Give me some advice about {t}.",
    "Write a haiku about {t}.",
    "Summarize the history of {t}.",
    "Why is {t} important?",
    "Write a Python function related to {t}.",
    "Compare {t} with something similar.",
    "Describe {t} in simple words.",
    "What are the pros and cons of {t}?",
    "Tell me a joke about {t}.",
    "How does {t} work?",
    "Write a tweet about {t}.",
    "List some common questions people ask about {t}.",
    "Write an email to a friend about {t}.",
    "Translate into French: I love {t}.",
    "What should I know before learning about {t}?",
    "Write a short dialogue about {t}.",
    "Give step-by-step instructions involving {t}.",
    "Write a short poem about {t}.",
    "What is a common misconception about {t}?",
    "Describe a day in the life of someone who works with {t}.",
    "Explain {t} to a ten-year-old.",
    "What is the future of {t}?",
)
_TOPICS = (
    "photosynthesis", "the moon", "coffee", "volcanoes", "chess", "bicycles", "the ocean",
    "machine learning", "gardening", "the Roman Empire", "sleep", "rainbows", "JavaScript",
    "recycling", "dogs", "electric cars", "music theory", "bread baking", "the stock market",
    "honeybees", "climate change", "libraries", "the internet", "yoga", "deserts", "databases",
    "friendship", "airplanes", "vitamins", "ancient Egypt", "sorting algorithms", "football",
    "cloud computing", "mushrooms", "poetry", "the human heart", "solar panels", "time management",
    "cats", "linear algebra",
    "glaciers", "tea", "origami", "jazz", "the Great Wall of China", "earthquakes", "tigers",
    "submarines", "chocolate", "the printing press", "basketball", "owls", "compilers", "kites",
    "public transport", "vaccines", "the solar system", "knitting", "spiders", "wind turbines",
    "operating systems", "penguins", "the Renaissance", "marathons", "cheese", "lighthouses",
    "black holes", "board games", "rivers", "meditation", "the Olympic Games", "bridges",
    "dinosaurs", "photography", "encryption", "coral reefs", "tomatoes", "museums", "clocks",
    "rain forests", "recursion", "elephants", "pottery", "newspapers", "hurricanes", "the violin",
    "space stations", "fungi", "birthdays", "dolphins", "skateboarding", "the periodic table",
    "volunteering", "trains", "maps", "the immune system", "ice cream", "podcasts", "castles",
    "wolves", "spreadsheets", "bamboo", "comets", "minimalism", "the alphabet", "sunflowers",
    "video games", "beeswax", "hiking boots", "submarine cables", "cooking rice", "graph theory",
    "octopuses", "the Silk Road", "umbrellas", "snow", "pizza", "theatre", "archaeology", "lemons",
)  # fmt: skip


def synthetic_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct instructions (template x topic, up to 3000), a seeded sample; none is a
    benchmark prompt (bench/spec.py's kinds are other instructions on other topics)."""
    pool = [t.format(t=topic) for t in _TEMPLATES for topic in _TOPICS]
    if not 1 <= n <= len(pool):
        raise InvalidArgument("prompts", f"must be in [1, {len(pool)}], got {n}")
    return random.Random(seed).sample(pool, n)


@dataclass(frozen=True)
class Sample:
    """One text: token ids, and the target's argmax after each prefix (teacher-forced)."""

    ids: tuple[int, ...]
    start: int  # first position whose label is trained on (the last prompt token)
    labels: tuple[int, ...]


def read_texts(path: Path, target_export: Path) -> list[tuple[list[int], int]]:
    """(ids, start) per line of a JSONL file of ``{"prompt": ..., "text": ...}`` objects: the
    prompt as one chat message, the text as the target's answer (for example a serving log)."""
    from pipeshard.shard.prompting import Prompter

    prompter = Prompter.from_dir(target_export)
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, text = row["prompt"], row["text"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(
                "texts", f"{path}:{n} is not a {{prompt, text}} JSON object ({exc})"
            ) from None
        ids = prompter.encode(prompt, [])
        out.append((ids + list(prompter.tokenizer.encode(text, add_special_tokens=False)), len(ids) - 1))
    if not out:
        raise InvalidArgument("texts", f"{path} holds no texts")
    return out


def generate_texts(
    target_export: Path, prompts: Sequence[str], max_tokens: int, report: Report
) -> list[tuple[list[int], int]]:
    """(ids, start) per prompt: the target's own greedy answer, the very text a draft will read."""
    from pipeshard.shard.chain import LocalChain
    from pipeshard.shard.prompting import Prompter

    prompter = Prompter.from_dir(target_export)
    chain = LocalChain(target_export)
    out = []
    for i, prompt in enumerate(prompts):
        ids = prompter.encode(prompt, [])
        chain.reset()
        answer = chain.generate_greedy(ids, max_tokens, eos_ids=sorted(prompter.eos_ids)).token_ids
        out.append((ids + list(answer), len(ids) - 1))
        report("generate", (i + 1) / len(prompts), f"{i + 1}/{len(prompts)} answers")
    return out


def label(target_export: Path, texts: Sequence[tuple[list[int], int]], report: Report) -> list[Sample]:
    """The target's argmax at every position of every text, in one prefill per text."""
    from pipeshard.shard.chain import LocalChain

    chain = LocalChain(target_export)
    samples = []
    for i, (ids, start) in enumerate(texts):
        ids = ids[: chain.max_context]
        chain.reset()
        logits = chain.step(np.asarray([ids], dtype=np.int64), return_last=len(ids))[0]
        samples.append(Sample(tuple(ids), start, tuple(int(t) for t in logits.argmax(-1))))
        report("label", (i + 1) / len(texts), f"{i + 1}/{len(texts)} texts")
    return samples


class TrainableDraft:
    """The k-layer model being trained, with its head rows as their own parameter."""

    def __init__(self, folder: Path, vocab_ids: Sequence[int] | None):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        embed = self.model.get_input_embeddings().weight
        embed.requires_grad_(False)  # the input side stays the target's: the draft reads its tokens
        vocab = embed.shape[0]
        self.ids = torch.as_tensor(vocab_ids if vocab_ids is not None else range(vocab), dtype=torch.long)
        self.column = torch.full((vocab,), -100, dtype=torch.long)
        self.column[self.ids] = torch.arange(len(self.ids))
        self.head = torch.nn.Parameter(embed[self.ids].detach().clone())
        self.body = self.model.get_decoder()

    def parameters(self) -> list:
        return [p for p in self.body.parameters() if p.requires_grad] + [self.head]

    def forward(self, batch: Sequence[Sample]):
        """Head-slice logits [B, T, V'] and targets [B, T] (-100: not trained on)."""
        import torch

        length = max(len(s.ids) for s in batch)
        x = torch.zeros((len(batch), length), dtype=torch.long)
        mask = torch.zeros_like(x)
        y = torch.full_like(x, -100)
        for i, s in enumerate(batch):
            n = len(s.ids)
            x[i, :n] = torch.as_tensor(s.ids)
            mask[i, :n] = 1
            y[i, s.start : n - 1] = self.column[torch.as_tensor(s.labels[s.start : n - 1])]
        hidden = self.body(input_ids=x, attention_mask=mask).last_hidden_state
        return hidden @ self.head.T, y

    def agreement(self, samples: Sequence[Sample]) -> float:
        """Share of trained positions where the draft's argmax is the target's (its acceptance
        at K = 1 when it drafts on the target's own text)."""
        import torch

        hits = total = 0
        with torch.no_grad():
            for s in samples:
                logits, _ = self.forward([s])
                n = len(s.ids)
                pred = self.ids[logits[0, s.start : n - 1].argmax(-1)]
                hits += int((pred == torch.as_tensor(s.labels[s.start : n - 1])).sum())
                total += n - 1 - s.start
        return hits / max(total, 1)

    def save(self, folder: Path) -> None:
        """Untie the head: the full embedding matrix with the trained rows put in."""
        import torch

        head = self.model.get_input_embeddings().weight.detach().clone()
        head[self.ids] = self.head.detach()
        self.model.config.tie_word_embeddings = False
        self.model.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
        self.model.lm_head.weight = torch.nn.Parameter(head)
        self.model.save_pretrained(folder, safe_serialization=True)


@dataclass(frozen=True)
class DistilResult:
    folder: Path  # the trained draft as a Hugging Face folder
    export: ExportResult  # its one-stage export (the vocabulary slice applied)
    agreement_before: float  # held-out agreement of the untrained prefix draft
    agreement_after: float


def train(
    draft: TrainableDraft,
    samples: list[Sample],
    *,
    epochs: float,
    lr: float,
    batch: int,
    seed: int,
    report: Report,
) -> None:
    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    steps = max(1, round(epochs * len(samples) / batch))
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    order: list[int] = []
    for step in range(steps):
        if len(order) < batch:
            order = rng.sample(range(len(samples)), len(samples))
        logits, y = draft.forward([samples[order.pop()] for _ in range(min(batch, len(order)))])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        report("train", (step + 1) / steps, f"step {step + 1}/{steps} loss {loss.item():.3f}")


def distil(
    model_dir: Path | str,
    target_export: Path | str,
    out_dir: Path | str,
    *,
    layers: int,
    vocab: int | None = None,
    texts: Path | None = None,
    prompts: int = 200,
    max_tokens: int = 128,
    epochs: float = 2.0,
    lr: float = 1e-3,
    batch: int = 8,
    held_out: float = 0.1,
    seed: int = 0,
    report: Report | None = None,
    **export_options,
) -> DistilResult:
    """Train a ``layers``-layer draft of ``model_dir`` on the labels of ``target_export`` (texts
    from the JSONL file ``texts``, else the target's answers to ``prompts`` synthetic prompts);
    writes ``<out_dir>/hf`` and exports it to ``<out_dir>/export``."""
    report = report or (lambda phase, fraction, message: None)
    model_dir, target_export, out_dir = Path(model_dir), Path(target_export), Path(out_dir)
    plan = plan_draft(model_dir, layers, vocab)  # validates layers and vocab before any work
    if not 0 < held_out < 1:
        raise InvalidArgument("held_out", f"must be in (0, 1), got {held_out}")
    if texts is not None:
        sequences = read_texts(texts, target_export)
    else:
        sequences = generate_texts(target_export, synthetic_prompts(prompts, seed), max_tokens, report)
    samples = label(target_export, sequences, report)
    random.Random(seed).shuffle(samples)
    n_eval = max(1, round(held_out * len(samples)))
    if len(samples) - n_eval < 1:
        raise InvalidArgument(
            "prompts", f"{len(samples)} texts leave nothing to train on after the held-out share"
        )
    evaluation, training = samples[:n_eval], samples[n_eval:]

    out_dir.mkdir(parents=True, exist_ok=True)
    folder = out_dir / "hf"
    work = out_dir / f".prefix-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    truncate_model(model_dir, work, layers)
    try:
        draft = TrainableDraft(work, plan.vocab_ids)
        before = draft.agreement(evaluation)
        report("train", 0.0, f"held-out agreement before {before:.3f}")
        train(draft, training, epochs=epochs, lr=lr, batch=batch, seed=seed, report=report)
        after = draft.agreement(evaluation)
        report("train", 1.0, f"held-out agreement after {after:.3f}")
        shutil.rmtree(folder, ignore_errors=True)
        draft.save(folder)
        for name in TOKENIZER_FILES:
            if name != "config.json" and (model_dir / name).is_file():
                shutil.copy2(model_dir / name, folder / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # The folder holds only the draft's layers: all of them, with the slice picked from the target.
    whole = DraftPlan(layers, plan.source_layers, plan.vocab_ids)
    export = export_model(folder, out_dir / "export", stages=1, draft=whole, **export_options)
    return DistilResult(folder, export, before, after)
