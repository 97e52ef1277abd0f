"""A request's life on the coordinator: open a session on every stage, prefill, decode, release.

Each request owns its session (its own KV state on every stage), so any number run
concurrently on one ring. A request is state (``_Request``), not a coroutine that steps itself:
the caller's coroutine (:meth:`Generation.generate`) opens it and hands it to the engine loop
(engine.py), which plans its rows into steps with the others' and hands each answer to
:meth:`Generation.update` (acceptance, emission into its output queue, stop checks); the caller
only reads that queue, then keeps and releases the request once it ended.

Decoding is speculative when the request asks for a draft source: each step sends the last
token plus K drafted tokens through the pipeline in one traversal (K = 0 is a plain step) and
keeps what the target agrees with. Rejected positions stay in every stage's cache and are
masked out by the next frame's mask update; positions are logical, so the sequence continues
as if they had never been written.

With a prefix index (prefix caching), a request first restores on every stage the longest
prefix of its prompt that a finished request of the same client left in the stages' caches, and
prefills only the rest; a finished request leaves its own sequence there. A restore that fails
anywhere (a stage evicted the entry, refused it, or missed the deadline) is thrown away whole:
the session goes and the request prefills cold in a new one. The index (prefix_cache.py) holds
the stages' block keys and forgets what their keep and restore replies report dropped, so a
restore that fails because a stage no longer holds the prefix is an exception, counted by
``pipeshard_coordinator_prefix_stage_misses_total``.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import structlog

from pipeshard import trace
from pipeshard.errors import InvalidArgument, PipeshardError, Unavailable
from pipeshard.metrics import (
    GENERATED_TOKENS,
    INTER_TOKEN,
    PREFIX_STAGE_MISSES,
    SPECULATIVE_ACCEPTED,
    SPECULATIVE_DRAFTED,
    SPECULATIVE_DROPPED_STEPS,
    TIME_TO_FIRST_TOKEN,
    TOKENS_PER_TRAVERSAL,
)
from pipeshard.sampling import accept_sampled, restore_rng, rng_state
from pipeshard.services.coordinator.detokenizer import IncrementalDetokenizer
from pipeshard.services.coordinator.engine import (
    EngineCore,
    RequestId,
    RequestStatus,
    Row,
    Upcoming,
    new_request_id,
)
from pipeshard.services.coordinator.grammar import Constraint, Grammars
from pipeshard.services.coordinator.kv_standby import StandbyCopy
from pipeshard.services.coordinator.prefix_cache import PrefixIndex
from pipeshard.services.coordinator.ring import RingLike, ShuttingDown, StageFailed
from pipeshard.services.coordinator.sampling import (
    LogitShaper,
    Sampler,
    SamplingParams,
    token_logprobs,
    top_logprobs,
)
from pipeshard.services.coordinator.speculation.acceptance import accept_greedy
from pipeshard.services.coordinator.speculation.choice import AUTO, SourceChoice
from pipeshard.services.coordinator.speculation.depth import InFlightDepth, worth_sending
from pipeshard.services.coordinator.speculation.drafts import Draft, Drafter
from pipeshard.services.coordinator.speculation.policy import KPolicy, SourceMemory, StepLoad, TimingModel
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.services.coordinator.speculation.tree import (
    ROOT,
    TREE_AUTO,
    TREE_OFF,
    TreeChains,
    TreeChoice,
    TreeNodes,
    TreeOutcome,
    TreeShape,
    accept_tree_greedy,
    accept_tree_sampled,
)
from pipeshard.services.coordinator.step_answer import StepAnswer, read_answer
from pipeshard.services.coordinator.step_batcher import DEFAULT_PREFILL_CHUNK, BatchSteps, Grouping, StepSlot
from pipeshard.services.stage.domain import RowKind, SamplingStep, Step
from pipeshard.services.stage.wire import frame_from_step, token_row
from pipeshard.v1 import activation_pb2

if TYPE_CHECKING:
    from pipeshard.services.coordinator.failover import Failover
    from pipeshard.services.coordinator.scheduler import ScheduledRequest

log = structlog.get_logger(__name__)


# Steps that accepted at most this many tokens are detokenized on the event loop (two decodes of
# a few ids each, tens of microseconds); longer ones on a worker thread, so a slow decode does not
# stall other streams. A thread hop per token cost 0.3 ms at the median and 2.8 ms at p90 of a
# 1-user step (bench-latency's timeline, docs/BENCHMARKS.md).
INLINE_DETOKENIZE_TOKENS = 4


# Chunks a request may run ahead of its reader: beyond them it is not planned until its reader
# takes one (a slow reader holds up its own request only).
STREAM_EVENTS = 64


@dataclass(frozen=True)
class _Ended:
    """The engine is done with the request (finished, or the error that ended it, for its reader)."""

    error: Exception | None = None


@dataclass(frozen=True)
class Speculation:
    """What a request asked of speculation, checked once (``Generation.check_speculative``) and
    trusted from there on: the draft source (``none``: plain decoding; ``auto``: the one measured
    fastest, chosen as the request opens), fixed K (0: adaptive) and the tree choice."""

    mode: str = "none"
    k: int = 0
    tree: TreeChoice = TREE_AUTO


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)  # per token, when the request asked
    tokens: list[str] = field(default_factory=list)  # each token's own text, likewise
    top: list[TopTokens] = field(default_factory=list)  # per token, when top_logprobs was asked


@dataclass
class TopTokens:
    """The most likely tokens at one position, most likely first."""

    token_ids: list[int]
    logprobs: list[float]
    tokens: list[str] = field(default_factory=list)


@dataclass
class Summary:
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    tok_s: float
    text: str
    token_ids: list[int]
    error: str = ""
    speculative: str = "none"
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)  # per generated token, when asked
    cached_tokens: int = 0  # prompt positions restored from the prefix cache instead of prefilled
    kept_per_traversal: list[int] = field(default_factory=list)  # [i]: decode steps that kept i + 1
    dropped_steps: int = 0  # steps sent while an earlier one travelled, dropped unused


@dataclass
class Progress:
    """What a running request has accumulated so far; its Summary is formed once it ends."""

    speculative: str = "none"
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)  # per generated token, when asked
    cached_tokens: int = 0  # prompt positions restored from the prefix cache
    kept_per_traversal: list[int] = field(default_factory=list)  # [i]: decode steps that kept i + 1
    dropped_steps: int = 0  # steps sent while an earlier one travelled, dropped unused

    def kept(self, tokens: int) -> None:
        """A decode traversal kept ``tokens`` tokens."""
        grow = tokens - len(self.kept_per_traversal)
        if grow > 0:
            self.kept_per_traversal.extend([0] * grow)
        self.kept_per_traversal[tokens - 1] += 1

    error: str = ""


@dataclass(eq=False)
class _Flight:
    """A row of the request that carries its next token (a decode or verify row, or the prompt's
    last chunk) from the moment it is built until its answer is taken or it is dropped:
    ``guessed`` its first token is a guess (the bonus token of the step before it, taken from the
    draft's continuation of that step's proposal), ``logical`` the cursor's logical length before
    it, ``positions`` the cache positions it writes."""

    draft: Draft | TreeChains | TreeNodes
    guessed: bool
    logical: int
    positions: int


class _Cursor:
    """Where one session's cache stands on every stage: physical length written, logical
    length kept, and the rejected ranges the next frame must mask out."""

    def __init__(self, session_id: str, greedy: bool, *, truncates: bool = False, probabilities: bool = True):
        self.session_id = session_id
        self.greedy = greedy
        self.probabilities = probabilities  # Top1 answers carry them (only logprobs read them)
        self.truncates = truncates  # the ring rewinds by shortening the cache (paged): no holes
        self.step = 0
        self.physical = 0
        self.logical = 0
        self._rejected: list[tuple[int, int]] = []
        self._keep_chain = -1  # after a tree step: the chain whose cache the stages keep
        self._kept: tuple[int, ...] = ()  # after a tree step as one sequence: the tokens kept
        self._tree_base = 0  # the logical length before the last tree step

    def frame(
        self,
        ids: list[int],
        *,
        fill_only: bool = False,
        return_last: int = 1,
        sampling: SamplingStep | None = None,
        kind: RowKind | None = None,
        chains: int = 1,
        parents: tuple[int, ...] = (),
        features: bool = False,
        heads: int = 0,
        allowed: bytes = b"",
    ) -> activation_pb2.ActivationFrame:
        """``chains`` > 1: ``ids`` are a draft tree's chains, each advancing the cache alike;
        ``parents``: ``ids`` are a draft tree as one sequence (each id's parent among them);
        ``features``: the final stage returns its final hidden state too (a feature draft's);
        ``heads``: the final stage's draft heads return that many candidates each."""
        self._tree_base = self.logical
        row = token_row(
            self.session_id,
            self.step,
            ids,
            self.logical,
            self.greedy,
            fill_only=fill_only,
            return_last=return_last,
            invalidate=self._rejected,
            sampling=sampling,
            kind=kind,
            chains=chains,
            keep_chain=self._keep_chain,
            parents=parents,
            kept=self._kept,
            probabilities=self.probabilities,
            features=features,
            heads=heads,
            allowed=allowed,
        )
        frame = frame_from_step(Step([row], sent_unix_nanos=time.time_ns()))
        self._rejected = []
        self._keep_chain = -1
        self._kept = ()
        self.step += 1
        self.physical += len(ids) // chains
        self.logical += len(ids) // chains
        return frame

    def keep_chain(self, chain: int) -> None:
        """The last (tree) step's chain ``chain`` holds the accepted path: the stages keep it."""
        self._keep_chain = chain

    def keep_tokens(self, kept: tuple[int, ...]) -> None:
        """The last (tree) step's tokens ``kept`` are the accepted path: the stages move their
        cache behind the step's start."""
        self._kept = kept

    @property
    def settled(self) -> int:
        """Logical positions that sit in the session's one cache row on every stage: all of them,
        or, while a tree step's chosen chain or path is not yet sent, those before that step."""
        return self.logical if self._keep_chain < 0 and not self._kept else self._tree_base

    def restored(self, positions: int) -> None:
        """The session starts with ``positions`` positions restored on every stage."""
        self.physical = self.logical = positions

    def reject(self, n: int) -> None:
        """The last ``n`` positions written hold rejected drafts."""
        if n:
            self._rejected.append((self.physical - n, self.physical))
            self.logical -= n
            if self.truncates:
                self.physical -= n


def _take(
    new: list[int], generated: list[int], detok: IncrementalDetokenizer, stop_ids: set[int], max_tokens: int
) -> tuple[list[int], str | None, str]:
    """Appends accepted tokens up to a stop or the limit: (tokens emitted, finish reason once the
    request is done else None, text delta)."""
    emitted: list[int] = []
    finish = None
    for token in new:
        generated.append(token)
        emitted.append(token)
        if token in stop_ids:
            finish = "stop"
        else:
            detok.add(token)
            if detok.stopped:
                finish = "stop"
        if finish is None and len(generated) >= max_tokens:
            finish = "length"
        if finish is not None:
            break
    return emitted, finish, detok.delta(final=finish is not None)


class _Request:
    """One request's state across its steps, so each phase of ``Generation.run`` is a small method."""

    def __init__(
        self,
        request_id: RequestId,
        session_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        mode: str,
        max_context: int,
        reserved: int | None = None,
        drafter: Drafter | None,
        final_stage_sampling: bool = True,
        prune: bool = True,
        policy: KPolicy,
        detok: IncrementalDetokenizer,
        stop_ids: set[int],
        metered: bool = True,
        truncates: bool = False,
        tree: TreeChoice = TREE_OFF,
        constraint: Constraint | None = None,
        grouping: Grouping | None = None,
        admission: ScheduledRequest | None = None,
    ):
        self.id = request_id  # for its whole life; its sessions change (failover, a failed restore)
        self.status = RequestStatus.PREFILLING
        self.session_id = session_id
        self.admission = admission  # the scheduler's: its sessions carry its KV charge
        # Its place in the engine's batching, for its whole life.
        self.slot = StepSlot(grouping, identity="" if admission is None else admission.identity.name)
        self.standby = StandbyCopy()  # its KV captured ahead of a failover (kv_standby.py), when on
        # Structured output, penalties, logit_bias: tokens are chosen here from shaped logits.
        self.constraint = constraint
        self.shaper = LogitShaper(params, constraint) if params.chooses_here else None
        self.new_top: list[TopTokens] = []  # of the tokens the last step accepted, when asked
        self.tree = tree
        self.outcome: TreeOutcome | None = None  # what the last tree step accepted
        self.metered = metered  # False for the coordinator's warm-up: not a client's tokens
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_context = max_context
        self.reserved = reserved or max_context  # the cache room the session holds on paged stages
        self.drafter = drafter
        self.reads_features = drafter is not None and drafter.reads_features
        # Draft heads follow the greedy path on the final stage: greedy requests only.
        self.heads = drafter.head_candidates if drafter is not None and self.top1 else 0
        self.policy = policy
        self.cursor = _Cursor(session_id, self.top1, truncates=truncates, probabilities=params.logprobs)
        self.detok = detok
        self.sampler = None if params.greedy else Sampler(params)
        self.sample = None if self.sampler is None else (self.sampler.probabilities, self.sampler.rng)
        self.final_stage_sampling = final_stage_sampling
        self.prune = prune
        self.stop_ids = stop_ids
        self.context = list(prompt_ids)
        self.generated: list[int] = []
        self.progress = Progress(speculative=mode)
        self.started = time.perf_counter()
        self.first_at = self.started
        self.finish: str | None = None  # "stop", "length" or "error" once it has ended
        self.pending: list[int] = []  # tokens the stages have not seen yet
        self.emitted_at = self.started  # when the last tokens were handed out
        self.new_logprobs: list[float] = []  # of the tokens the last step accepted, when asked
        # Its output stream: chunks, then the end, for its reader (never blocks the engine).
        self.output: asyncio.Queue[Chunk | _Ended] = asyncio.Queue()
        self.outbox: list[Chunk] = []  # chunks of the step just answered, handed over once the next left
        self.parked = False  # its reader is STREAM_EVENTS behind: not planned until it catches up
        self.streaming_step = 0  # the step whose tokens are streaming (the trace's key)
        self.steps_in_flight = 0  # the engine's: its steps travelling (more than one: sent ahead)
        self.landed = asyncio.Event()  # set while none is
        self.landed.set()
        # One answer's update at a time, in the order its rows were sent.
        self.turn = asyncio.Condition()
        self.flights: list[_Flight] = []  # its rows carrying its next tokens in flight, oldest first
        self.ahead: list[int] = []  # the tokens they add if each is accepted whole (guesses included)
        self.depth: InFlightDepth | None = None  # its speculative rows' in-flight depth (None: 1)
        self.refeed = False  # rows in flight were dropped: the next row re-feeds the last kept token
        self.rode_alone = False  # its last step carried its row only (it may send ahead)
        self.sent_ahead = False  # its update sent its next step already
        self.batch_aware = True  # K for the load of the step being formed (else as if alone)
        self.scope = ""  # whose prefix cache entries it may use, and whether it uses them
        self.cache = False
        self.moving: asyncio.Task | None = None  # its failover, while it runs
        self.replaying: list[list[int]] = []  # a failover's replay: its chunks still to send
        self.replay_started = 0.0  # when its replay was handed to the engine (perf_counter)
        # Its caller's context (the RPC's request id in its logs, a batch job's session codec):
        # made while the caller opens it, and where its failover runs.
        self.caller = contextvars.copy_context()

    @property
    def top1(self) -> bool:
        """The final stage answers with its argmax (greedy, unconstrained); else with logits or draws."""
        return self.params.greedy and self.shaper is None

    def upcoming(self, chunk: int) -> Upcoming:
        """Its next row before drafting: a chunk of the prompt while it prefills (the last one
        returns its first token), else its pending tokens."""
        if self.status is RequestStatus.PREFILLING:
            left = len(self.prompt_ids) - self.cursor.logical
            return Upcoming(min(left, chunk), decoding=False, first=self.cursor.step == 0)
        if self.status is RequestStatus.REPLAYING:
            return Upcoming(len(self.replaying[0]), decoding=False, first=False)
        return Upcoming(len(self.pending), decoding=True, first=False)

    def next_row(self, chunk: int, load: StepLoad, budget: int) -> Row:
        """Its next row (the engine's schedule calls it for each row it plans): a fill-only chunk
        of all of the prompt but its last chunk, so other sessions' decode steps interleave with a
        long prompt (the chunk size is fixed per server, never chosen by load, so a request's
        output cannot depend on its neighbours); then the pending tokens plus any drafts, K
        chosen for ``load`` (the rest of the step) within ``budget`` positions."""
        if self.status is RequestStatus.REPLAYING:  # a failover's replay: a chunk of what it had seen
            frame = self.cursor.frame(self.replaying.pop(0), fill_only=True)
            trace.mark("gen_send", frame.session_id, frame.step_id)
            return Row(frame, decoding=False)
        prefilling = self.status is RequestStatus.PREFILLING  # (DECODING once its first token is in)
        if prefilling:
            start = self.cursor.logical
            if len(self.prompt_ids) - start > chunk:
                frame = self.cursor.frame(self.prompt_ids[start : start + chunk], fill_only=True)
                trace.mark("gen_send", frame.session_id, frame.step_id)
                return Row(frame, decoding=False)
            self.pending = self.prompt_ids[start:]
        load = load if self.batch_aware else StepLoad()
        logical = self.cursor.logical
        draft: Draft | TreeChains | TreeNodes
        if self.flights:  # built on the rows in flight being accepted whole
            guess, chain = self._continue(load, budget)
            draft, frame = chain, self.frame(chain, pending=[guess])
            self.ahead += [guess, *chain.tokens]
            flight = _Flight(chain, True, logical, 1 + len(chain.tokens))
        else:
            draft = self.draft(load, budget)
            frame = self.frame(draft)
            if isinstance(draft, Draft):
                self.ahead = list(draft.tokens)
            flight = _Flight(draft, False, logical, self.cursor.logical - logical)
        self.flights.append(flight)
        trace.mark("gen_send", frame.session_id, frame.step_id)
        return Row(frame, decoding=not prefilling, draft=draft)

    @property
    def pipelining(self) -> bool:
        """Whether its rows may travel several at once (speculation/depth.py): greedy, unshaped
        chains from a draft that continues its own proposals (prompt lookup; a feature draft, over
        its own predicted features). Sampled rows go one at a time (their acceptance draws from
        each step's distributions: D = 1 keeps it exact simply), and so do explicit trees, draft
        models and draft heads (each drafts from the last step's answer or its own cache)."""
        drafter = self.drafter
        return (
            self.depth is not None
            and drafter is not None
            and drafter.pipelines
            and self.top1
            and self.tree.shape is None
            and self.depth.depth() > 1
        )

    def pipelines(self) -> bool:
        """Whether its next row may go while its rows in flight travel: it decodes with fewer than
        D rows in flight, the latest a chain, the reader keeps up, the rows in flight leave it
        tokens to make and cache room, the row is likely enough to stand when other requests share
        its steps (speculation/depth.py), and its draft has a guess of their bonus token."""
        if not (self.flights and self.status is RequestStatus.DECODING and self.pipelining):
            return False
        assert self.depth is not None and self.drafter is not None
        if len(self.flights) >= self.depth.depth() or not isinstance(self.flights[-1].draft, Draft):
            return False
        if self.output.qsize() + len(self.outbox) >= STREAM_EVENTS or self._pipelined_room() < 0:
            return False
        context = self.context + self.ahead
        acceptance = self.policy.acceptance_of(self.drafter.part(context))
        if not worth_sending(acceptance, len(self.ahead), not self.rode_alone):
            return False
        return bool(self.drafter.propose(context, 1, None, len(self.ahead)).tokens)

    def _pipelined_room(self) -> int:
        """Drafts a row built on the rows in flight may carry besides its guessed first token:
        the tokens left past those they add (and the guess's own bonus), and the cache room left
        once the request may still finish plainly (negative: no such row)."""
        remaining = self.params.max_tokens - len(self.generated)
        tokens = remaining - len(self.ahead) - 2
        room = self.max_context - self.cursor.physical - remaining - 1
        return min(tokens, room)

    def _continue(self, load: StepLoad, budget: int) -> tuple[int, Draft]:
        """A row built on the rows in flight: the guessed bonus token of the latest one (its
        draft's next proposal) and the drafts after it, K chosen for ``load`` within ``budget``."""
        assert self.drafter is not None
        limit = min(self._pipelined_room(), budget)
        context = self.context + self.ahead
        k = self.policy.choose(limit, load, self.drafter.part(context)) if limit > 0 else 0
        proposal = self.drafter.propose(context, k + 1, None, len(self.ahead))
        if not proposal.tokens:
            raise RuntimeError("a row was planned on the rows in flight without a guess to continue from")
        guess, *tokens = proposal.tokens
        return guess, Draft(tokens, None, proposal.seconds, proposal.part)

    def expedite(self) -> None:
        """Its next step leaves at once, not after the steps in flight (a failover's resend)."""
        self.slot.expedited = True

    def move_to(self, session_id: str) -> list[int]:
        """Starts the request over in a new, empty session (failover.py); returns the tokens it
        must be prefilled with before the next step: everything the old session had seen. The
        same session id (a per-hop failover: the session is cut back, not replaced) keeps its step
        count, so no late answer of a lost step is taken for a new one."""
        self.status = RequestStatus.MOVING
        step = self.cursor.step if session_id == self.session_id else 0
        self.session_id = session_id
        params = self.params
        self.cursor = _Cursor(
            session_id, self.top1, truncates=self.cursor.truncates, probabilities=params.logprobs
        )
        self.cursor.step = step
        self.replaying = []
        if not self.generated:
            return []  # still prefilling: next_row starts the prompt again
        return self.context[: len(self.context) - len(self.pending)]

    def replay(self, tokens: list[int], chunk: int) -> None:
        """Its new session is to be brought up to ``tokens`` (what a restore did not bring back):
        all but their last chunk become its rows while it is REPLAYING, fill-only chunks the engine
        plans like a prompt's; the last chunk goes ahead of the pending tokens, so the next step
        (the one that failed, sent again) replays it too and one step less stands between the
        failover and the next token."""
        last = len(tokens) - (len(tokens) % chunk or min(chunk, len(tokens)))
        self.replaying = [tokens[start : start + chunk] for start in range(0, last, chunk)]
        self.pending = tokens[last:] + self.pending
        if self.replaying:
            self.status = RequestStatus.REPLAYING
            self.replay_started = time.perf_counter()
        else:
            self.resumed()

    def resumed(self) -> None:
        """Its failover is done (or its replay's last chunk answered): it goes on where it stood."""
        if self.status in (RequestStatus.MOVING, RequestStatus.REPLAYING) and not self.replaying:
            self.status = RequestStatus.DECODING if self.generated else RequestStatus.PREFILLING

    def draft(self, load: StepLoad, budget: int) -> Draft | TreeChains | TreeNodes:
        """Chooses K (or the tree's shape) for a row joining ``load`` with at most ``budget``
        draft positions, and drafts (none on the first step or without a drafter); a tree with
        one path goes as a chain."""
        if self.drafter is None or not self.generated or self.cursor.logical < len(self.prompt_ids):
            # (a row that still carries prompt tokens, after a failover's replay, is a prompt's
            # chunk: it returns its last position only)
            return Draft([], None, 0.0)
        remaining = self.params.max_tokens - len(self.generated)
        # Rejected drafts use cache room too: always leave room to finish plainly.
        limit = min(remaining - 1, self.max_context - self.cursor.physical - remaining, budget)
        floor = 0.0
        if self.tree.shape is not None:
            shape = TreeShape(self.tree.shape.width, min(self.tree.shape.depth, limit))
        else:
            # auto: greedy requests only (a sampled tree step ships every chain's logits back); at
            # D > 1, chains (the rows in flight take a tree's place)
            auto = self.tree.mode == "auto" and self.sampler is None and not self.pipelining
            width = self.drafter.auto_tree_width if auto else 1
            paths, k_step = self.policy.choose_shape(limit, width, load, self.drafter.part(self.context))
            if paths == 1 or not k_step:
                if not k_step:
                    return Draft([], None, 0.0)
                return self.drafter.propose(self.context, k_step, self.sample)
            shape = TreeShape(paths, k_step)
            floor = self.policy.prune_floor(paths, k_step) if self.prune else 0.0
        if shape.depth < 1:
            return Draft([], None, 0.0)
        tree = self.drafter.propose_tree(self.context, shape).pruned(floor)
        if self.cursor.truncates:  # one sequence of every node: it must fit the session's room
            tree = tree.first(min(self.reserved - self.cursor.physical - len(self.pending), budget))
        if len(tree.leaves()) > 1:  # paged stages (truncating rewinds) take the one-sequence form
            return TreeNodes(tree) if self.cursor.truncates else tree.chains()
        return Draft([n.token for n in tree.nodes], None, tree.seconds)

    def frame(
        self, draft: Draft | TreeChains | TreeNodes, pending: list[int] | None = None
    ) -> activation_pb2.ActivationFrame:
        """The step's frame: the pending tokens plus the draft, returning a row per draft token + 1
        (of a tree: per chain, the pending token and the chain's padded path). A row that still
        carries prompt tokens is the prompt's last chunk; then a decode row, or a verify row with
        drafts (a tree's chains are one verify row, and so are its nodes). ``pending``: a row
        built on the rows in flight starts from its guess instead."""
        if isinstance(draft, TreeNodes):
            return self.cursor.frame(
                draft.token_ids(self.pending),
                return_last=draft.rows,
                kind=RowKind.VERIFY,
                parents=draft.parents(len(self.pending)),
                features=self.reads_features,
                heads=self.heads,
            )
        if isinstance(draft, TreeChains):
            return self.cursor.frame(
                draft.token_ids(self.pending),
                return_last=draft.depth + 1,
                kind=RowKind.VERIFY,
                chains=draft.width,
                features=self.reads_features,
            )
        if self.cursor.logical < len(self.prompt_ids):
            kind = RowKind.PREFILL
        else:
            kind = RowKind.VERIFY if draft.tokens else RowKind.DECODE
        return self.cursor.frame(
            (self.pending if pending is None else pending) + draft.tokens,
            return_last=len(draft.tokens) + 1,
            sampling=self._sampling(draft),
            kind=kind,
            features=self.reads_features,
            heads=self.heads,
            allowed=self._allowed(draft),
        )

    def _allowed(self, draft: Draft) -> bytes:
        """The grammar's mask for the final stage to apply (its Top1 then is this step's token,
        no logits shipped): a greedy step without drafts whose only shaping is the grammar."""
        shaper = self.shaper
        if shaper is None or not shaper.mask_only or not self.params.greedy or draft.tokens:
            return b""
        return b"" if self.params.logprobs else shaper.allowed_bits()

    def _sampling(self, draft: Draft) -> SamplingStep | None:
        """The final stage draws (with this request's generator) unless the drafts carry their
        own distributions, which would cost more to ship than the logits they save, or the
        client asked for logprobs, which are computed here from the logits."""
        if (
            self.sampler is None
            or self.shaper is not None  # bias, penalties and the grammar's mask apply here
            or not self.final_stage_sampling
            or isinstance(draft, TreeChains | TreeNodes)  # trees are accepted here, from the logits
            or draft.probs is not None
            or self.params.logprobs
        ):
            return None
        return SamplingStep(self.sampler.distribution, rng_state(self.sampler.rng), list(draft.tokens))

    def accept(self, draft: Draft | TreeChains | TreeNodes, result: StepAnswer) -> list[int]:
        """The tokens this step keeps: the agreed draft prefix plus the target's next token."""
        new = self._accept(draft, result)
        if self.drafter is not None and self.reads_features:
            self._observe(self.drafter, draft, result, new)
        if self.drafter is not None and self.heads:
            self._observe_heads(self.drafter, draft, result, new)
        return new

    def _observe_heads(
        self,
        drafter: Drafter,
        draft: Draft | TreeChains | TreeNodes,
        result: StepAnswer,
        new: list[int],
    ) -> None:
        """Hands the drafter the final stage's head candidates when they were computed where this
        acceptance ended (the row before the target's own token); otherwise none this step."""
        candidates = result.heads
        # Tree chains ask for no heads (the stage cannot tell padding from drafts).
        usable = (
            candidates is not None
            and not isinstance(draft, TreeChains)
            and candidates.row == self._kept_row(draft, new)
        )
        drafter.observe_heads(candidates if usable else None)

    def _observe(
        self,
        drafter: Drafter,
        draft: Draft | TreeChains | TreeNodes,
        result: StepAnswer,
        new: list[int],
    ) -> None:
        """Hands a feature draft the target's features at the positions this step kept, in order:
        the pending token's and each accepted draft's (of a tree: the root's and the accepted
        path's rows), the last being the row before the target's own token."""
        if result.features is None:
            # A stage that cannot return them: the draft goes idle (a stale feature would draft
            # for a position the target has left), decoding stays exact.
            drafter.observe(None)
            return
        if isinstance(draft, TreeChains | TreeNodes):
            rows = [draft.row_of(node) for node in [ROOT, *self._tree_outcome.path]]
        else:
            rows = list(range(len(new)))
        drafter.observe(result.features[rows])

    def _kept_row(self, draft: Draft | TreeChains | TreeNodes, new: list[int]) -> int:
        """The result row of the last position this step kept (the row before the target's own
        token; of a tree, the accepted path's last node's row): where a feature-reading draft
        goes on from."""
        if isinstance(draft, TreeChains | TreeNodes):
            path = self._tree_outcome.path
            return draft.row_of(path[-1] if path else ROOT)
        return len(new) - 1

    @property
    def _tree_outcome(self) -> TreeOutcome:
        """What the last tree step accepted (``accept`` sets it before anything reads it)."""
        if self.outcome is None:
            raise RuntimeError("a tree step's outcome was read before its acceptance")
        return self.outcome

    def _accept(self, draft: Draft | TreeChains | TreeNodes, result: StepAnswer) -> list[int]:
        if isinstance(draft, TreeChains | TreeNodes):
            return self._accept_tree(draft, result)
        if self.shaper is not None:
            if result.logits is None and result.top1:  # the final stage applied the grammar's mask
                token = result.top1[0]
                self.shaper.took(token)
                return [token]
            return self._accept_shaped(draft, result, self.shaper)
        if self.sampler is None:
            new = accept_greedy(draft.tokens, result.top1)
            if self.params.logprobs:  # greedy keeps row i's argmax, whose probability Top1 carries
                self.new_logprobs = [math.log(p) for p in result.top1_probabilities[: len(new)]]
            return new
        if result.drawn is not None:  # drawn on the final stage: continue from its generator
            restore_rng(self.sampler.rng, result.drawn.rng_state, "sampled.rng_state")
            return result.drawn.token_ids
        rows = result.rows()
        new = accept_sampled(draft.tokens, draft.probs, rows, self.sampler.probabilities, self.sampler.rng)
        if self.params.logprobs:  # token i was drawn (or kept) from row i
            self.new_logprobs = token_logprobs(rows, new)
        return new

    def _accept_shaped(self, draft: Draft, result: StepAnswer, shaper: LogitShaper) -> list[int]:
        """Each position's token chosen from its shaped row (bias, penalties, the grammar's mask),
        in order: a greedy request keeps a draft while it equals the shaped argmax (so a draft
        that leaves the grammar is cut there, and the output equals plain decoding); a sampled one
        draws (no drafts)."""
        rows = result.rows()
        new: list[int] = []
        for i in range(len(draft.tokens) + 1):
            row = shaper.shaped(rows[i])
            if self.sampler is None:
                token = int(np.argmax(row))
            else:
                probs = self.sampler.probabilities(row)
                token = int(self.sampler.rng.choice(probs.size, p=probs))
            shaper.took(token)
            new.append(token)
            stopped = self.constraint is not None and self.constraint.stopped
            if stopped or i == len(draft.tokens) or token != draft.tokens[i]:
                break
        if self.params.logprobs:
            self.new_logprobs = token_logprobs(rows, new)
            if self.params.top_logprobs:
                self.new_top = [
                    TopTokens(*top_logprobs(rows[i], self.params.top_logprobs)) for i in range(len(new))
                ]
        return new

    def _accept_tree(self, chains: TreeChains | TreeNodes, result: StepAnswer) -> list[int]:
        if self.sampler is None:
            self.outcome = accept_tree_greedy(chains, result.top1)
        else:
            logits = result.rows()
            self.outcome = accept_tree_sampled(chains, logits, self.sampler.probabilities, self.sampler.rng)
        if self.params.logprobs:  # token i came from the row after the i-th node of the path
            rows = [chains.row_of(node) for node in [ROOT, *self.outcome.path]]
            if self.sampler is None:
                self.new_logprobs = [math.log(result.top1_probabilities[r]) for r in rows]
            else:
                self.new_logprobs = token_logprobs(logits[rows], self.outcome.tokens)
        return self.outcome.tokens

    def settle(self, new: list[int]) -> int:
        """Takes the answered row off its rows in flight. When its answer breaks what the later
        ones assumed (a rejected draft, or another bonus token than the next one's guess) they are
        dropped: nothing of them is used, and their positions (the cache's tail) are rewound with
        the rejected drafts by the next row's mask; how many positions that is."""
        answered = self.flights.pop(0)
        if not self.flights:
            self.ahead = []
            return 0
        whole = isinstance(answered.draft, Draft) and len(new) == len(answered.draft.tokens) + 1
        if whole:  # its drafts all kept: the next row's guess of the bonus token is tested
            guessed = self.flights[0].draft
            self.policy.observe_guess(
                new == self.ahead[: len(new)], guessed.part if isinstance(guessed, Draft) else ""
            )
        if whole and new == self.ahead[: len(new)]:
            self.ahead = self.ahead[len(new) :]
            return 0
        positions = sum(f.positions for f in self.flights)
        self.drop_flights()
        # The next row also feeds the last accepted token again (its slot is rewound too): a stage
        # that runs one-token rows as two (invariant paged stages re-feed the input of the cache's
        # last slot from their last step) last saw a dropped row, so the row brings that input.
        self.refeed = True
        return positions + 1

    def drop_flights(self) -> None:
        """Its rows in flight are not to be used (a rejection under them, a failover, its end)."""
        dropped = sum(f.guessed for f in self.flights)
        self.flights = []
        self.ahead = []
        if dropped:
            self.progress.dropped_steps += dropped
            if self.metered:
                SPECULATIVE_DROPPED_STEPS.labels(source=self.progress.speculative).inc(dropped)

    @property
    def written(self) -> int:
        """Positions every stage holds for the accepted tokens: the settled ones before its first
        row in flight."""
        return self.flights[0].logical if self.flights else self.cursor.settled

    def carries(self, row: Row) -> bool:
        """Whether the row is one of its rows in flight (not dropped)."""
        return any(f.draft is row.draft for f in self.flights)

    def waits(self, row: Row) -> bool:
        """Whether an earlier row of it in flight has not been answered yet."""
        return self.carries(row) and self.flights[0].draft is not row.draft

    def record(
        self, draft: Draft | TreeChains | TreeNodes, new: list[int], elapsed: float, beyond: int = 0
    ) -> None:
        """Masks rejected drafts out of the cache (and ``beyond`` positions of dropped rows after
        them) and feeds the K policy and the summary counters."""
        kept = len(new) - 1
        if isinstance(draft, TreeChains | TreeNodes):
            outcome = self._tree_outcome
            if isinstance(draft, TreeNodes):
                # The stages move the accepted path's cache down behind the pending tokens and
                # drop the nodes' slots past it.
                self.cursor.reject(len(draft.tree.nodes) - kept)
                self.cursor.keep_tokens(draft.kept(len(self.pending), outcome.path))
                positions = len(self.pending) + len(draft.tree.nodes)
            else:
                # The stages keep the accepted path's chain; its tail past the path is masked out.
                self.cursor.reject(draft.depth - kept)
                self.cursor.keep_chain(outcome.chain)
                positions = draft.width * (draft.depth + 1)
            main = draft.tree.main
            fed = next((i for i, n in enumerate(outcome.path) if i >= len(main) or main[i] != n), kept)
            depth, proposed, seconds = draft.depth, len(draft.tree.nodes), draft.tree.seconds
            width, part = draft.width, ""
        else:
            self.cursor.reject(len(draft.tokens) - kept + beyond)
            fed = kept
            depth = proposed = len(draft.tokens)
            seconds, positions = draft.seconds, None
            width, part = 1, draft.part
        if self.drafter is not None and self.generated:
            self.drafter.commit(fed)
            self.policy.observe(depth, kept, elapsed, seconds, positions, width, part)
            if proposed:
                self.progress.verify_steps += 1
                self.progress.draft_tokens += proposed
                self.progress.accepted_tokens += kept
                if self.metered:
                    SPECULATIVE_DRAFTED.labels(source=self.progress.speculative).inc(proposed)
                    SPECULATIVE_ACCEPTED.labels(source=self.progress.speculative).inc(kept)
        if self.generated and new:
            self.progress.kept(len(new))
            if self.metered:
                TOKENS_PER_TRAVERSAL.labels(source=self.progress.speculative).observe(len(new))
        if not self.generated:
            self.first_at = time.perf_counter()
            self.status = RequestStatus.DECODING  # its first token is in

    async def emit(self, new: list[int]) -> tuple[Chunk, bool]:
        """The chunk for the accepted tokens and whether the request is done (stop or length)."""
        args = (new, self.generated, self.detok, self.stop_ids, self.params.max_tokens)
        if len(new) <= INLINE_DETOKENIZE_TOKENS:
            emitted, self.finish, text = _take(*args)
        else:
            emitted, self.finish, text = await asyncio.to_thread(_take, *args)
        if self.finish is None and self.constraint is not None and self.constraint.stopped:
            self.finish = "stop"  # the grammar is complete and allows nothing more
            text += self.detok.delta(final=True)
        done = self.finish is not None
        if done:
            self.status = RequestStatus.FINISHED
        if self.metered:
            self._meter(len(emitted))
        if not done:
            self.context.extend(new)
            self.pending = self.context[-2:] if self.refeed else [new[-1]]
        self.refeed = False
        chunk = Chunk(text=text, token_ids=emitted)
        if self.params.logprobs:
            chunk.logprobs = self.new_logprobs[: len(emitted)]
            chunk.top = self.new_top[: len(emitted)]
            self.progress.logprobs.extend(chunk.logprobs)
        return chunk, done

    def _meter(self, tokens: int) -> None:
        """Tokens streamed, TTFT (as in the summary) and the time per token since the last chunk."""
        now = time.perf_counter()
        GENERATED_TOKENS.inc(tokens)
        if len(self.generated) == tokens:  # the first chunk
            TIME_TO_FIRST_TOKEN.observe(self.first_at - self.started)
        elif tokens:
            per_token = (now - self.emitted_at) / tokens
            for _ in range(tokens):
                INTER_TOKEN.observe(per_token)
        self.emitted_at = now

    def sends_ahead(self, new: list[int]) -> bool:
        """Whether the next step may go before this one's tokens are detokenized and streamed: a
        plain decode (no drafter, whose drafts need the context) that rode alone (a step of many
        rows is formed again from all of them at once), that neither a stop token nor the length
        limit ends, and whose reader keeps up. Only a stop string can still end it; that step is
        then dropped."""
        return (
            self.drafter is None
            and self.rode_alone
            and len(self.generated) + len(new) < self.params.max_tokens
            and not self.stop_ids.intersection(new)
            and self.output.qsize() < STREAM_EVENTS
        )

    def summary(self) -> Summary:
        """The final Summary of an ended request: finish reason, counts and timings."""
        if self.finish is None:
            raise RuntimeError("a running request has no summary yet")
        elapsed = time.perf_counter() - self.first_at
        n = len(self.generated)
        p = self.progress
        return Summary(
            finish_reason=self.finish,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=n,
            ttft_ms=(self.first_at - self.started) * 1000.0,
            tok_s=(n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
            text=self.detok.text,
            token_ids=self.generated,
            error=p.error,
            speculative=p.speculative,
            verify_steps=p.verify_steps,
            draft_tokens=p.draft_tokens,
            accepted_tokens=p.accepted_tokens,
            kept_per_traversal=list(p.kept_per_traversal),
            dropped_steps=p.dropped_steps,
            logprobs=p.logprobs,
            cached_tokens=p.cached_tokens,
        )


class Generation:
    """Runs one request over the ring, yielding Chunks and then one Summary."""

    def __init__(
        self,
        ring: RingLike,
        tokenizer,
        eos_ids: set[int],
        *,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        drafts: DraftSources | None = None,
        default_speculative: str = "none",
        max_k: int = 10,
        final_stage_sampling: bool = True,
        tree_prune: bool = True,
        prefix: PrefixIndex | None = None,
        restore_timeout_s: float = 5.0,
        batch_aware_k: bool = True,
        failover: Failover | None = None,
        grammars: Grammars | None = None,
        spec_depth: int = 0,
    ):
        """``failover``: moves a running request off a failed replica lane instead of failing it;
        ``grammars``: compiles structured outputs' grammars (None: refused); ``spec_depth``: the
        most speculative steps of one request in flight at once (0: chosen from the measured round
        trip and compute, speculation/depth.py; 1: one at a time)."""
        self.depth = InFlightDepth(spec_depth)
        self._ring = ring
        self._grammars = grammars
        self._failover = failover
        self.prefix = prefix
        self.restore_timeout_s = restore_timeout_s
        self._prefill_chunk = prefill_chunk
        self._tok = tokenizer
        self._eos = eos_ids
        self._drafts = drafts
        self.default_speculative = default_speculative
        self.max_k = max_k
        self.final_stage_sampling = final_stage_sampling
        self.tree_prune = tree_prune  # tree=auto: prune nodes that do not pay (policy.prune_floor)
        self.timing = TimingModel()  # traversal cost by positions, learned across requests
        self._sources: dict[str, SourceMemory] = {}  # acceptance by draft source, across requests
        self.choice = SourceChoice()  # ``auto``: the source each default request gets, by measurement
        self._releases: set[asyncio.Task] = set()
        # The requests running, by their id, and the loop that plans their rows into steps.
        self.engine: EngineCore[_Request] = EngineCore(
            self._run_step,
            self._answered,
            self._end,
            steps=ring.batch_steps,
            prefill_chunk=prefill_chunk,
        )
        self.engine.depth = self.depth.depth()
        # A ring that batches every step (paged) times its steps, and the engine drafts for the
        # step it is forming, which batch-aware K weighs (speculation/policy.py); ``batch_aware_k``
        # False chooses K as if alone, from the request's own wall time per step (A/B).
        self._steps: BatchSteps | None = ring.batch_steps if batch_aware_k else None

    @property
    def step_batcher(self) -> BatchSteps | None:
        """The ring's batching settings (paged backend), whose ``inflight`` a batch job reads."""
        return self._ring.batch_steps

    @property
    def num_stages(self) -> int:
        return self._ring.num_stages

    async def released(self) -> None:
        """Waits for the session releases still under way (before the ring closes)."""
        await asyncio.gather(*self._releases, return_exceptions=True)

    async def close(self, reason: str = "the coordinator's engine closed") -> None:
        """Stops the engine this generation started (its task, its steps in flight, the
        failovers under way) before the event loop ends; a request still running ends with
        :class:`ShuttingDown` naming ``reason``, which its reader raises or ends its summary with."""
        moving = [r.moving for r in self.engine.requests.values() if r.moving is not None]
        for task in moving:
            task.cancel()
        await asyncio.gather(*moving, return_exceptions=True)
        await self.engine.close(ShuttingDown(reason))
        await self.released()

    def offer_drafts(self, drafts: DraftSources, default_speculative: str) -> None:
        """New draft sources and default for requests from now on (a feature draft whose training
        finished while the fleet ran, draft_watch.py); requests already admitted keep the source
        they resolved and the drafter they hold."""
        self._drafts = drafts
        self.default_speculative = default_speculative

    def check_speculative(self, speculative: str, k: int, tree: str = "") -> Speculation:
        """What a request asked of speculation, as the typed value the rest trusts; InvalidArgument
        for an unknown source, K or tree."""
        mode = speculative or self.default_speculative
        if not 0 <= k <= 32:
            raise InvalidArgument("k", f"must be 0 (adaptive) or 1..32, got {k}")
        choice = TreeChoice.parse(tree)
        if choice.shape is not None and not self._ring.verifies_trees:
            raise InvalidArgument(
                "tree",
                f"is {tree!r} but this fleet's stages verify no draft trees (paged stages at a precision "
                "that promises bit-identical rows, static shards or u8 KV pools): use tree=auto or off, "
                "which draft chains",
            )
        if mode not in ("none", AUTO):  # auto without draft sources chooses plain
            if self._drafts is None:
                raise InvalidArgument("speculative", "this coordinator has no draft sources")
            self._drafts.validate(mode)
        return Speculation(mode, k, choice)

    async def check_grammar(self, params: SamplingParams) -> None:
        """InvalidArgument naming ``grammar`` when a request's grammar cannot be compiled (the
        compile is cached, so the request's own constraint then starts from it)."""
        if params.grammar is None:
            return
        if self._grammars is None:
            raise InvalidArgument("grammar", "is not supported by this coordinator")
        await asyncio.to_thread(self._grammars.compile, params.grammar)

    async def run(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        speculative: str = "",
        k: int = 0,
        metered: bool = True,
        scope: str = "",
        cache: bool = True,
        tree: str = "",
    ) -> AsyncIterator[Chunk | Summary]:
        """Checks the speculation a caller asked for by name (``tree``: draft trees, ``auto``
        (default), ``off`` or ``WxD``), then runs it as :meth:`generate`."""
        speculation = self.check_speculative(speculative, k, tree)
        await self.check_grammar(params)
        async for event in self.generate(
            prompt_ids, params, speculation, metered=metered, scope=scope, cache=cache
        ):
            yield event

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        speculation: Speculation,
        *,
        metered: bool = True,
        scope: str = "",
        cache: bool = True,
        reserved: int | None = None,
        grouping: Grouping | None = None,
        admission: ScheduledRequest | None = None,
    ) -> AsyncIterator[Chunk | Summary]:
        """Streams Chunks then one Summary; raises if nothing was streamed or a stage is
        unreachable, and otherwise ends a failed generation with an "error" Summary. The
        parameters were checked at the edge (the servicer, or :meth:`run`). ``metered``
        False keeps a generation (the coordinator's warm-up) out of the token metrics; ``scope``
        names whose prefix cache entries the request may use (its client); ``cache=False`` keeps
        it out of the prefix cache; ``reserved``: the cache room admission counted for it
        (None: :meth:`capacity`); ``grouping``: its batch job's micro-batches (batch_jobs.py);
        ``admission``: the scheduler's admission, whose KV charge its sessions take over."""
        request = await self._open(prompt_ids, params, speculation, metered, reserved, grouping, admission)
        request.scope, request.cache = scope, cache and self.prefix is not None
        request.depth = self.depth
        failure = ""  # why the generation failed on the ring, if it did
        try:
            if request.cache:
                await self._warm(request, scope)
            self.engine.ready(request)  # from here the engine steps it; this coroutine reads
            while True:
                event = await request.output.get()
                if isinstance(event, _Ended):
                    break
                self._unpark(request)
                yield event
                trace.mark("streamed", request.session_id, request.streaming_step)
            await request.landed.wait()  # a step sent ahead of a stop string's end: waited out
            if event.error is not None:
                raise event.error
            if request.cache:
                await self._keep(request, scope)
        except PipeshardError as exc:
            failure = str(exc) or type(exc).__name__
            if not request.generated or isinstance(exc, Unavailable):
                # Nothing streamed yet, or a stage is unreachable (a fault a client may retry, and
                # a drain's end): the call ends with that status code, naming the stage.
                raise
            # Output already streamed: end it with a summary that says what failed.
            log.warning("generation_failed", session_id=request.session_id, code=exc.code, error=failure)
            request.finish, request.progress.error = "error", failure
        finally:
            self._close(request, failure)  # on every way out, the client's going away included
        summary = request.summary()
        adaptive = speculation.k == 0 and speculation.tree.shape is None
        if adaptive and metered and summary.finish_reason != "error":
            # what its source (or plain) measured on this fleet under adaptive K: auto's evidence
            self.choice.observe(summary.speculative, summary.completion_tokens, summary.tok_s)
        yield summary

    async def _open(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        speculation: Speculation,
        metered: bool,
        reserved: int | None,
        grouping: Grouping | None,
        admission: ScheduledRequest | None = None,
    ) -> _Request:
        """Opens the request's session on every stage and sets up its drafter and K policy."""
        mode, k, tree = speculation.mode, speculation.k, speculation.tree
        if mode == AUTO:  # the source measured fastest on this fleet (speculation/choice.py)
            offered = self._drafts.names if self._drafts is not None else []
            mode = self.choice.choose(offered, peek=not metered)  # the warm-up leaves it as it was
        constraint = None
        if params.grammar is not None:
            grammars = self._grammars
            assert grammars is not None  # check_grammar refused the grammar at the edge otherwise
            constraint = await asyncio.to_thread(grammars.constraint, params.grammar)
        if not self._ring.verifies_trees:
            tree = TREE_OFF  # the stages take chains only (an explicit shape was refused at the edge)
        if params.shapes_logits:
            # Drafts are verified position by position on shaped rows: chains only, greedy only
            # (a sampled request draws each token from its shaped distribution).
            tree = TREE_OFF
            if not params.greedy:
                mode = "none"
        # check_speculative refused any mode but "none" without draft sources
        factory = None if mode == "none" or self._drafts is None else await self._drafts.factory(mode)
        request_id = new_request_id()
        session_id = request_id  # its first session's id; later ones are new (failover, restore)
        reserved = reserved or self.capacity(prompt_ids, params)
        max_context = await self._ring.open_session(session_id, reserved, admission)
        drafter = factory() if factory else None
        # What adaptive K learnt of the source, from adaptive requests only: a fixed K's deep drafts
        # keep less per draft (the feature draft: 0.10 at K = 5 against 0.27 adaptive, quick
        # bench-spec at 25 ms), which would pull the source's adaptive requests toward K = 0.
        memory = None if mode == "none" or k else self._sources.setdefault(mode, SourceMemory())
        steps = self._steps
        policy = KPolicy(
            self.timing if steps is None else steps.timing,
            fixed_k=k or None,
            max_k=self.max_k,
            memory=memory,
            times_steps=steps is None,
        )
        request = _Request(
            request_id,
            session_id,
            prompt_ids,
            params,
            mode=mode,
            max_context=max_context,
            reserved=reserved,
            drafter=drafter,
            final_stage_sampling=self.final_stage_sampling,
            prune=self.tree_prune,
            policy=policy,
            detok=IncrementalDetokenizer(self._tok, params.stop, params.resumed),
            # A grammar ends at end-of-sequence, whatever ignore_eos says.
            stop_ids=set(params.stop_token_ids)
            | (set() if params.ignore_eos and constraint is None else self._eos),
            metered=metered,
            truncates=self._ring.truncates_on_rewind,
            tree=tree,
            constraint=constraint,
            grouping=grouping,
            admission=admission,
        )
        request.batch_aware = steps is not None
        self.engine.add(request)
        return request

    def capacity(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The cache room a request can use (what a paged stage reserves): its prompt, its tokens
        and one verify step's drafts."""
        return len(prompt_ids) + params.max_tokens + self.max_k + 1

    async def _warm(self, request: _Request, scope: str) -> None:
        """Restores the longest cached prefix of the prompt on every stage, or none of it."""
        prefix = self.prefix
        hit = None if prefix is None else prefix.lookup(scope, request.prompt_ids)
        if prefix is None or hit is None:
            return
        try:
            dropped = await asyncio.wait_for(
                self._ring.restore_kv(
                    request.session_id, scope, hit.tokens, hit.positions, self.restore_timeout_s
                ),
                self.restore_timeout_s,
            )
        except (PipeshardError, TimeoutError) as exc:
            prefix.unpin(hit)
            prefix.drop(hit)
            if isinstance(exc, StageFailed) and exc.code == "NOT_FOUND":
                PREFIX_STAGE_MISSES.inc()  # the index held what a stage did not
            reason = str(exc) or type(exc).__name__
            log.info(
                "prefix_cache_fallback", session_id=request.session_id, positions=hit.positions, reason=reason
            )
            # Nothing half-restored is used: the session goes, the request runs cold in a new one
            # (opened once the old one is gone, so the two never hold the stages' KV together).
            await self._ring.abort_session(request.session_id, f"prefix restore failed: {reason}")
            request.session_id = request.cursor.session_id = uuid.uuid4().hex
            await self._ring.open_session(request.session_id, request.reserved, request.admission)
            return
        except BaseException:  # cancelled (the client went away): the entry stays usable
            prefix.unpin(hit)
            raise
        prefix.unpin(hit)
        prefix.forget(dropped)
        request.cursor.restored(hit.positions)
        request.progress.cached_tokens = hit.positions
        log.info("prefix_cache_hit", session_id=request.session_id, positions=hit.positions)

    async def _keep(self, request: _Request, scope: str) -> None:
        """Leaves the finished sequence in every stage's prefix cache (all but the last token,
        which no stage has seen) and indexes it, less the blocks the stages report dropped; a
        failure only costs the next request its hit."""
        prefix = self.prefix
        sequence = request.prompt_ids + request.generated
        tokens = sequence[: min(request.cursor.settled, len(sequence) - 1)]
        if prefix is None or len(tokens) < prefix.min_tokens:
            return
        try:
            dropped = await asyncio.wait_for(
                self._ring.keep_kv(request.session_id, scope, tokens), self.restore_timeout_s
            )
        except (PipeshardError, TimeoutError) as exc:
            log.info("prefix_cache_keep_failed", session_id=request.session_id, reason=str(exc) or "timeout")
            return
        prefix.add(scope, tokens)
        prefix.forget(dropped)
        log.debug(
            "prefix_cache_kept", session_id=request.session_id, positions=len(tokens), dropped=len(dropped)
        )

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _run_step(self, frames: list[activation_pb2.ActivationFrame]) -> list:
        """Carries one step the engine formed: through a batching ring as one plan, else the one
        row alone."""
        if self._ring.batch_steps is not None:
            return await self._ring.run(frames)
        (frame,) = frames
        try:
            return [await self._ring.step(frame)]
        except Exception as exc:
            return [exc]

    async def _answered(self, rows: Sequence[tuple[_Request, Row]], answers: list, elapsed: float) -> None:
        """A step's answers, each to its request (the engine calls this): the rows' updates run
        side by side, so every request of the step is ready again before the next is formed."""
        if len(rows) == 1:  # alone: no task of its own needed
            (request, row), (answer,) = rows[0], answers
            await self._answer(request, row, answer, elapsed, alone=True)
        else:
            await asyncio.gather(
                *(
                    self._answer(request, row, answer, elapsed, alone=False)
                    for (request, row), answer in zip(rows, answers, strict=True)
                )
            )
        # The readers get the chunks once the next step (formed right after this) is on its way,
        # so their streaming overlaps the stages' work instead of delaying its start.
        asyncio.get_running_loop().call_soon(self._deliver, [request for request, _ in rows])

    @staticmethod
    def _deliver(requests: list[_Request]) -> None:
        """Hands the requests' new chunks to their readers."""
        for request in requests:
            for chunk in request.outbox:
                request.output.put_nowait(chunk)
            request.outbox.clear()

    async def _answer(self, request: _Request, row: Row, answer, elapsed: float, alone: bool) -> None:
        """One row's answer: a failure ends or moves the request, a chunk only filled its cache,
        a decode row goes through :meth:`update`; then the request is ready again or ends."""
        async with request.turn:  # one update at a time, in the order the rows were sent
            try:
                await request.turn.wait_for(lambda: not request.waits(row))
                if request.status is RequestStatus.FINISHED:
                    return  # ended meanwhile (a stop string, its client gone): the answer is not used
                if row.draft is not None and not request.carries(row):
                    return  # dropped: built on a draft its step before rejected, or failed over
                if isinstance(answer, BaseException):
                    self._step_failed(request, answer)
                    return
                try:
                    if row.draft is None:  # a prompt's or a replay's chunk: the cache holds it now
                        self._computed(request, request.context[: request.cursor.logical])
                        if request.status is RequestStatus.REPLAYING:
                            request.resumed()  # after its replay's last chunk, the lost step
                            if request.status is not RequestStatus.REPLAYING:
                                log.info(
                                    "failover_replayed",
                                    session_id=request.session_id,
                                    positions=request.cursor.logical,
                                    replay_ms=round((time.perf_counter() - request.replay_started) * 1000, 1),
                                )
                        done = False
                    else:
                        request.streaming_step = row.frame.step_id
                        trace.mark("gen_result", request.session_id, row.frame.step_id)
                        request.rode_alone = alone
                        if row.decoding:
                            self._measured(elapsed, answer)
                        done = await self.update(request, row.draft, read_answer(answer), elapsed)
                except Exception as exc:
                    self._end(request, exc)
                    return
            finally:
                request.turn.notify_all()
        if done:
            self._end(request)
        elif request.sent_ahead:
            request.sent_ahead = False
        elif not request.flights or request.pipelines():  # else the rows in flight answer first
            self._ready(request)

    def _measured(self, elapsed: float, answer: activation_pb2.StepResult) -> None:
        """A decode step's round trip and the stages' compute in it: what auto depth is chosen from."""
        self.depth.observe(elapsed, list(answer.stage_compute_micros))
        self.engine.depth = self.depth.depth()

    async def update(
        self, request: _Request, draft: Draft | TreeChains | TreeNodes, answer: StepAnswer, elapsed: float
    ) -> bool:
        """Every decode step's result goes through here: acceptance, the K policy and the cache's
        bookkeeping, then emission (detokenizing, stop strings, stop tokens, the length limit)
        into the request's output stream; whether the request is done (its release follows on
        every way out, :meth:`generate`). A plain decode that rode alone has its next step sent
        before this one's tokens are detokenized and streamed, so the stages compute while this
        process streams (``_Request.sends_ahead``)."""
        new = request.accept(draft, answer)
        beyond = request.settle(new)
        request.record(draft, new, elapsed, beyond)
        # Every stage holds the settled positions of what is accepted so far, short of the rows
        # still in flight (theirs may not be written yet).
        self._computed(request, (request.prompt_ids + request.generated + new)[: request.written])
        if request.sends_ahead(new):
            request.pending = [new[-1]]
            request.sent_ahead = True
            self.engine.ready(request)
            if self.engine.pump():
                await asyncio.sleep(0)  # the step starts on its way before this token is streamed
        chunk, done = await request.emit(new)
        trace.mark("emitted", request.session_id, request.streaming_step)
        if request.params.logprobs:  # each token's own text, for OpenAI's logprobs objects
            chunk.tokens = await asyncio.to_thread(self._token_texts, list(chunk.token_ids))
            for top in chunk.top:
                top.tokens = await asyncio.to_thread(self._token_texts, list(top.token_ids))
        request.outbox.append(chunk)
        if done:
            self.engine.withdraw(request)  # a step sent ahead of a stop string goes unused
        return done

    def _step_failed(self, request: _Request, error: BaseException) -> None:
        """A step failed for the request: it moves to a healthy lane when its replica failed and
        another serves (failover.py, as a task of its own), else it ends with the error."""
        if not isinstance(error, Exception):
            raise error
        request.drop_flights()  # the rows after it fail too, or answer a session that moved
        self.engine.withdraw(request)  # ready again for a row built on it: not on this session
        failover = self._failover
        if isinstance(error, Unavailable) and failover is not None and failover.applies(error):
            request.status = RequestStatus.MOVING
            request.moving = asyncio.create_task(
                self._move(request, failover, error), name="failover", context=request.caller.copy()
            )
            return
        self._end(request, error)

    async def _move(self, request: _Request, failover: Failover, error: Unavailable) -> None:
        """Reopens, restores and replays the request on a healthy lane, then hands it back to the
        engine under the same id (its resent step goes first, alone)."""
        scope = request.scope
        warm = (lambda: self._warm(request, scope)) if request.cache else None
        try:
            await failover.resume(self._ring, request, error, request.reserved, self._prefill_chunk, warm)
        except Exception as exc:
            self._end(request, exc)
            return
        finally:
            request.moving = None
        request.resumed()
        self._ready(request)

    def _ready(self, request: _Request) -> None:
        """Back to the engine, unless its reader is behind (then its reader hands it back)."""
        if request.output.qsize() + len(request.outbox) >= STREAM_EVENTS:
            request.parked = True
        else:
            self.engine.ready(request)

    def _unpark(self, request: _Request) -> None:
        """Its reader took a chunk: a request parked on a slow reader is planned again."""
        if request.parked and request.output.qsize() < STREAM_EVENTS:
            request.parked = False
            self.engine.ready(request)

    def _end(self, request: _Request, error: Exception | None = None) -> None:
        """The engine is done with the request: out of its plans; its reader ends it."""
        if request.status is not RequestStatus.FINISHED or error is None:
            request.status = RequestStatus.FINISHED
            request.drop_flights()
            self.engine.withdraw(request)
            self._deliver([request])
            request.output.put_nowait(_Ended(error))

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (off the event loop: the tokenizer is slow per call)."""
        return [self._tok.decode([t]) for t in token_ids]

    def _computed(self, request: _Request, tokens: list[int]) -> None:
        """Every stage holds ``tokens`` for the request's session: its standby copy may follow."""
        if self._failover is not None:
            self._failover.computed(request, tokens)

    def _close(self, request: _Request, failure: str) -> None:
        """Frees the session on every stage in the background, even when the client went away
        mid-stream; a failed generation aborts (each stage logs why) instead of releasing."""
        request.status = RequestStatus.FINISHED
        self.engine.remove(request)
        if request.moving is not None:  # the client went away while it moved
            request.moving.cancel()
        if request.drafter is not None:
            request.drafter.close()
        if self._failover is not None:
            self._failover.ended(request)
        self._in_background(
            self._ring.abort_session(request.session_id, failure)
            if failure
            else self._ring.release_session(request.session_id)
        )
