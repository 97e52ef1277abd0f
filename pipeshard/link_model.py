"""Per-link compression decided from measurement (``--codec auto``).

A link's sender keeps a :class:`LinkEstimate`: the round-trip time as a windowed minimum of
acknowledgement times, and the bandwidth as a windowed maximum of delivery-rate samples
(bytes / (ack time - RTT)) of frames large enough to time. Queueing behind a busy receiver
only lengthens an ack, so the min/max filters keep the link's own figures (as BBR does).
The transport feeds it from a probe train at connect and then from acknowledged traffic.

:class:`CodecChooser` keeps, per dtype, what each codec costs on this sender's own data
(ratio, compress and decompress seconds per raw byte, re-measured on one frame in
``shadow_every``) and picks the codec with the least ``wire bytes / bandwidth + CPU time``.
Compression is on only where the wire time it saves exceeds the CPU time it spends (by
``margin``); on loopback the bandwidth is so high that it stays off. Unknown bandwidth: off.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog

from pipeshard.errors import InvalidArgument
from pipeshard.metrics import counter, gauge
from pipeshard.tensor_codec import Codec, decode, encode

log = structlog.get_logger(__name__)

CODEC_NAMES = {
    "none": Codec.CODEC_NONE,
    "zstd": Codec.CODEC_ZSTD,
    "byte_split_zstd": Codec.CODEC_BYTE_SPLIT_ZSTD,
    "lane_blocks_zstd": Codec.CODEC_LANE_BLOCKS_ZSTD,
    "quantum_zstd": Codec.CODEC_QUANTUM_ZSTD,
}
AUTO = "auto"
# Candidates for auto: BYTE_SPLIT is never smaller than LANE_BLOCKS on hidden states
# (make bench-compress), so measuring it would only cost CPU; QUANTUM (fp32 only) saves 4 points
# of raw over LANE_BLOCKS on decode frames for about 4x its CPU time, which pays only below a few
# Mbit/s, so it is a fixed choice (--codec quantum_zstd), not measured on every link.
AUTO_CANDIDATES = (Codec.CODEC_ZSTD, Codec.CODEC_LANE_BLOCKS_ZSTD)
# Smaller frames time the RTT, not the bandwidth; larger than a token bucket's usual burst
# (tbf burst 64 KB), so a passive sample is not a burst at line rate.
MIN_TIMED_BYTES = 256 * 1024
SHADOW_BYTES = 64 * 1024  # what each shadow measurement of the candidates encodes at most

LINK_BANDWIDTH = gauge(
    "pipeshard_link_bandwidth_bytes_per_second", "Measured bandwidth of a hop (windowed max)", ["link"]
)
LINK_RTT = gauge("pipeshard_link_rtt_seconds", "Measured round-trip time of a hop (windowed min)", ["link"])
LINK_CODEC = gauge("pipeshard_link_codec", "1 for the codec a hop currently sends with", ["link", "codec"])
LINK_FRAMES = counter("pipeshard_link_frames_total", "Tensors sent on a hop, by codec", ["link", "codec"])
LINK_RAW = counter("pipeshard_link_raw_bytes_total", "Tensor bytes before encoding, by hop", ["link"])
LINK_WIRE = counter("pipeshard_link_wire_bytes_total", "Tensor bytes after encoding, by hop", ["link"])


def train_rate(train: list[tuple[int, float]]) -> float:
    """Bandwidth from a probe train's (bytes, arrival time) samples: the bytes after the first over
    the time they took to arrive behind it (a token bucket lets the first through at line rate)."""
    (_, first), *rest = train
    return sum(n for n, _ in rest) / max(rest[-1][1] - first, 1e-6)


class LinkEstimate:
    """RTT (windowed min) and bandwidth (windowed max) of one link, from timed acknowledgements."""

    def __init__(self, link: str, window: int = 64):
        self.link = link
        self._rtts: deque[float] = deque(maxlen=window)
        self._rates: deque[float] = deque(maxlen=window)
        self._large: deque[tuple[int, float]] = deque(maxlen=window)
        self._passive: list[float] = []

    @property
    def rtt_s(self) -> float | None:
        return min(self._rtts) if self._rtts else None

    @property
    def bandwidth_bytes_s(self) -> float | None:
        rates = [*self._rates, *self._passive]
        return max(rates) if rates else None

    def observe(self, nbytes: int, elapsed_s: float) -> None:
        """One acknowledged send: ``nbytes`` on the wire, acknowledged ``elapsed_s`` after writing.
        Small sends time the RTT; large ones give a rate once an RTT is known."""
        if nbytes < MIN_TIMED_BYTES:
            self._rtts.append(elapsed_s)
        else:
            self._large.append((nbytes, elapsed_s))
        rtt = self.rtt_s
        if rtt is None:
            return
        LINK_RTT.labels(self.link).set(rtt)
        # Re-derive from every large sample: a smaller RTT seen later sharpens older ones.
        self._passive = [size / max(elapsed - rtt, 1e-6) for size, elapsed in self._large]
        self._publish()

    def observe_rate(self, bytes_s: float) -> None:
        """A rate measured directly (a probe train's spacing)."""
        self._rates.append(bytes_s)
        self._publish()

    def _publish(self) -> None:
        if self.bandwidth_bytes_s is not None:
            LINK_BANDWIDTH.labels(self.link).set(self.bandwidth_bytes_s)


@dataclass
class CodecCost:
    """What one codec costs on this sender's data (EWMA over shadow measurements)."""

    ratio: float = 1.0
    encode_s_per_byte: float = 0.0
    decode_s_per_byte: float = 0.0
    samples: int = 0

    def observe(self, ratio: float, encode_s_per_byte: float, decode_s_per_byte: float, alpha: float = 0.3):
        keep = 0.0 if self.samples == 0 else 1.0 - alpha
        self.ratio = keep * self.ratio + (1 - keep) * ratio
        self.encode_s_per_byte = keep * self.encode_s_per_byte + (1 - keep) * encode_s_per_byte
        self.decode_s_per_byte = keep * self.decode_s_per_byte + (1 - keep) * decode_s_per_byte
        self.samples += 1


def transfer_cost_s(nbytes: int, cost: CodecCost | None, bandwidth_bytes_s: float) -> float:
    """Seconds to move ``nbytes`` of raw tensor: wire time plus compress and decompress time."""
    if cost is None:
        return nbytes / bandwidth_bytes_s
    cpu = nbytes * (cost.encode_s_per_byte + cost.decode_s_per_byte)
    return nbytes * cost.ratio / bandwidth_bytes_s + cpu


def best_codec(
    nbytes: int,
    costs: dict[Codec, CodecCost],
    bandwidth_bytes_s: float | None,
    margin: float = 0.05,
    current: Codec = Codec.CODEC_NONE,
) -> Codec:
    """The codec that moves ``nbytes`` soonest. Leaving ``current`` (none at first) takes a saving
    of more than ``margin``, so a link near break-even does not flap between choices."""
    if bandwidth_bytes_s is None or nbytes == 0:
        return Codec.CODEC_NONE
    options = {Codec.CODEC_NONE: transfer_cost_s(nbytes, None, bandwidth_bytes_s)}
    options |= {c: transfer_cost_s(nbytes, cost, bandwidth_bytes_s) for c, cost in costs.items()}
    best = min(options, key=options.__getitem__)
    if current in options and options[best] > options[current] * (1 - margin):
        return current
    return best


def parse_codec(value: str) -> str:
    if value != AUTO and value not in CODEC_NAMES:
        raise InvalidArgument("codec", f"must be one of {[AUTO, *CODEC_NAMES]}, got {value!r}")
    return value


def check_wire_dtype(codec: str, wire_dtype: str) -> None:
    """QUANTUM reads fp32 lanes, so it cannot follow a narrowed (fp16/bf16) wire: refused where the
    stage starts with it and where a session asks for it."""
    if codec == "quantum_zstd" and wire_dtype != "fp32":
        raise InvalidArgument(
            "codec", f"quantum_zstd takes fp32 hidden states, not --wire-dtype {wire_dtype}"
        )


class CodecChooser:
    """The codec one link sends tensors with: fixed, or ``auto`` from :class:`LinkEstimate`."""

    def __init__(
        self,
        mode: str,
        link: LinkEstimate | None,
        *,
        shadow_every: int = 32,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.mode = parse_codec(mode)
        self.link = link
        self.shadow_every = shadow_every
        self._clock = clock
        self._costs: dict[str, dict[Codec, CodecCost]] = {}
        self._sent = 0
        self.current: Codec | None = None
        self._link_name = link.link if link is not None else "unmeasured"

    def with_mode(self, mode: str) -> CodecChooser:
        """A chooser for the same link with another mode (a session's own codec choice)."""
        return CodecChooser(mode, self.link, shadow_every=self.shadow_every, clock=self._clock)

    def for_link(self, link: LinkEstimate) -> CodecChooser:
        """A chooser for another link with this one's mode, shadow period and clock."""
        return CodecChooser(self.mode, link, shadow_every=self.shadow_every, clock=self._clock)

    def choose(self, array: np.ndarray) -> Codec:
        """The codec for this tensor (measuring every candidate on it now and then)."""
        if self.mode != AUTO:
            codec = CODEC_NAMES[self.mode]
        else:
            key = array.dtype.str
            costs = self._costs.setdefault(key, {})
            if self._sent % self.shadow_every == 0 or len(costs) < len(AUTO_CANDIDATES):
                self._measure(array, costs)
            self._sent += 1
            bandwidth = self.link.bandwidth_bytes_s if self.link is not None else None
            codec = best_codec(array.nbytes, costs, bandwidth, current=self.current or Codec.CODEC_NONE)
        self._record(codec)
        return codec

    def sent(self, raw_bytes: int, wire_bytes: int, codec: Codec) -> None:
        LINK_FRAMES.labels(self._link_name, Codec.Name(codec)).inc()
        LINK_RAW.labels(self._link_name).inc(raw_bytes)
        LINK_WIRE.labels(self._link_name).inc(wire_bytes)

    def _measure(self, array: np.ndarray, costs: dict[Codec, CodecCost]) -> None:
        # A slice is enough to know the ratio and speed, and keeps a long prefill from stalling.
        sample = np.ascontiguousarray(array).reshape(-1)[: SHADOW_BYTES // max(array.itemsize, 1)]
        n = max(sample.nbytes, 1)
        for codec in AUTO_CANDIDATES:
            t0 = self._clock()
            wire = encode(sample, codec)
            t1 = self._clock()
            decode(wire)
            t2 = self._clock()
            costs.setdefault(codec, CodecCost()).observe(len(wire.data) / n, (t1 - t0) / n, (t2 - t1) / n)

    def _record(self, codec: Codec) -> None:
        if codec == self.current:
            return
        if self.current is not None:
            LINK_CODEC.labels(self._link_name, Codec.Name(self.current)).set(0)
        LINK_CODEC.labels(self._link_name, Codec.Name(codec)).set(1)
        link = self.link
        log.info(
            "link_codec",
            link=self._link_name,
            mode=self.mode,
            codec=Codec.Name(codec),
            bandwidth_bytes_s=None if link is None else link.bandwidth_bytes_s,
            rtt_s=None if link is None else link.rtt_s,
        )
        self.current = codec
