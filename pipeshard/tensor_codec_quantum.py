"""CODEC_QUANTUM_ZSTD: fp32 activations with the mantissa bits below a common quantum left out.

SmolLM2's hidden states at `fast` precision are fp32 sums of terms computed in bf16, so
nearly every value is a multiple of about 2**-19 (make bench-compress): a value with exponent e
then has its lowest 150 + Q - e mantissa bits zero by construction. Byte lanes only partly see
that (the zero bits straddle lanes and depend on the exponent); here each mantissa keeps just the
bits above 2**Q, with Q chosen per frame, and the exponents (a few bits of entropy) go through
zstd. Values with a set bit below 2**Q are exceptions kept whole, listed by index. Exactly
lossless for every fp32 bit pattern (zeros, subnormals, inf and NaN keep all 23 bits).

Layout (little-endian): Q + 128 (u32), exception count (u32), zstd length (u32); exception
indices (u32, strictly increasing); a zstd frame of the n exponent bytes declaring its size; the
n sign bits packed; the kept mantissa bits packed, most significant first. Every length is
checked against the element count before anything is allocated, and the values are decoded
65536 at a time, so the working memory stays a few MiB above the output whatever the frame says.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

QUANTA = range(-26, -13)  # per-frame candidates; SmolLM2's hidden states sit at -19 to -17
_HEADER = 12
_CHUNK = 1 << 16  # values decoded at a time (a multiple of 8): bounds the working memory whatever n
_local = threading.local()  # zstd contexts are cheaper reused, but not thread-safe


class QuantumFrameError(ValueError):
    """A frame whose parts do not add up (the caller names the field)."""


def _widths(exponent: np.ndarray, q: int, exceptions: np.ndarray | None) -> np.ndarray:
    """Mantissa bits kept per value: all 23 for zeros, subnormals, inf/NaN and exceptions."""
    e = exponent.astype(np.int64)
    normal = (e >= 1) & (e <= 254)
    cut = np.where(normal, np.clip(q + 150 - e, 0, 23), 0)
    if exceptions is not None:
        cut[exceptions] = 0
    return 23 - cut


def _best_quantum(exponent: np.ndarray, mantissa: np.ndarray) -> int:
    """The Q with the fewest bits (kept mantissa bits, plus an index and the cut bits per
    exception), among the quanta that leave out 0.5 to 10% of the values' lowest set bits."""
    low = mantissa & (~mantissa + np.uint32(1))  # lowest set bit (0 for a zero mantissa)
    lowest = np.where(mantissa != 0, np.log2(np.maximum(low, 1)).astype(np.int64), 23)
    position = exponent.astype(np.int64) - 150 + lowest  # log2 of the value's lowest set bit
    normal = (exponent >= 1) & (exponent <= 254)
    if not normal.any():
        return QUANTA[0]
    marks = np.percentile(position[normal], [0.5, 1, 2, 5, 10]).astype(np.int64).tolist()
    candidates = sorted({min(max(m + d, QUANTA[0]), QUANTA[-1]) for m in marks for d in (0, 1)})
    best, best_bits = candidates[0], None
    for q in candidates:
        widths = _widths(exponent, q, None)
        exceptions = (widths < 23) & (position < q)
        bits = int(widths.sum()) + int(exceptions.sum()) * 32 + int((23 - widths[exceptions]).sum())
        if best_bits is None or bits < best_bits:
            best, best_bits = q, bits
    return best


def encode_fp32(values: np.ndarray, zdict: zstandard.ZstdCompressionDict | None = None) -> bytes:
    """Pack float32 ``values``; ``zdict`` codes the exponents with a shared dictionary (analysis)."""
    bits = np.ascontiguousarray(values, dtype="<f4").reshape(-1).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.uint8)
    mantissa = bits & np.uint32(0x7FFFFF)
    q = _best_quantum(exponent, mantissa)
    cut = (23 - _widths(exponent, q, None)).astype(np.uint32)
    exceptions = np.flatnonzero(mantissa & ((np.uint32(1) << cut) - np.uint32(1))).astype("<u4")
    widths = _widths(exponent, q, exceptions)
    kept = np.unpackbits(mantissa.astype(">u4").view(np.uint8).reshape(-1, 4), axis=1)[:, 9:]
    kept = kept[np.arange(23)[None, :] < widths[:, None]]
    zexp = _exponent_compressor(zdict).compress(exponent.tobytes())
    head = np.asarray([q + 128, exceptions.size, len(zexp)], dtype="<u4").tobytes()
    signs = np.packbits((bits >> 31).astype(np.uint8))
    return b"".join((head, exceptions.tobytes(), zexp, signs.tobytes(), np.packbits(kept).tobytes()))


def decode_fp32(data: bytes, n: int, zdict: zstandard.ZstdCompressionDict | None = None) -> np.ndarray:
    """The ``n`` float32 values of a frame (as uint32 bits), or :class:`QuantumFrameError`."""
    if len(data) < _HEADER:
        raise QuantumFrameError(f"is {len(data)} bytes, shorter than the {_HEADER}-byte header")
    q, n_exc, zlen = (int(v) for v in np.frombuffer(data[:_HEADER], dtype="<u4"))
    q -= 128
    if q not in QUANTA:
        raise QuantumFrameError(f"declares quantum 2**{q}, outside 2**{QUANTA[0]}..2**{QUANTA[-1]}")
    if n_exc > n:
        raise QuantumFrameError(f"declares {n_exc} exceptions for {n} values")
    at = _HEADER + 4 * n_exc
    if at + zlen > len(data):
        raise QuantumFrameError(f"declares {n_exc} exceptions and {zlen} exponent bytes beyond its end")
    exceptions = np.frombuffer(data[_HEADER:at], dtype="<u4").astype(np.int64)
    if n_exc and (exceptions[-1] >= n or (n_exc > 1 and np.any(np.diff(exceptions) <= 0))):
        raise QuantumFrameError("has exception indices out of order or out of range")
    zexp = data[at : at + zlen]
    try:
        if zstandard.frame_content_size(zexp) != n:
            raise QuantumFrameError(f"has an exponent frame not declaring {n} bytes")
        exponent = np.frombuffer(
            _exponent_decompressor(zdict).decompress(zexp, max_output_size=max(n, 1)), np.uint8
        )
    except zstandard.ZstdError as exc:
        raise QuantumFrameError(f"has an invalid exponent frame ({exc})") from None
    if exponent.size != n:
        raise QuantumFrameError(f"has {exponent.size} exponents for {n} values")
    at += zlen
    sign_bytes = (n + 7) // 8
    widths = np.empty(n, dtype=np.uint8)
    for a in range(0, n, _CHUNK):
        widths[a : a + _CHUNK] = _widths(exponent[a : a + _CHUNK], q, None)
    widths[exceptions] = 23
    need = at + sign_bytes + (int(widths.sum(dtype=np.int64)) + 7) // 8
    if len(data) != need:
        raise QuantumFrameError(f"is {len(data)} bytes but its parts need {need}")
    view = np.frombuffer(data, dtype=np.uint8)
    signs, stream = view[at : at + sign_bytes], view[at + sign_bytes :]
    out = np.empty(n, dtype=np.uint32)
    bit = 0
    for a in range(0, n, _CHUNK):  # a chunk at a time: the bit arrays are 32x the values
        w = widths[a : a + _CHUNK]
        count = int(w.sum(dtype=np.int64))
        skip = bit % 8
        kept = np.unpackbits(stream[bit // 8 : -(-(bit + count) // 8)])[skip : skip + count]
        padded = np.zeros((w.size, 32), dtype=np.uint8)
        padded[:, 9:][np.arange(23)[None, :] < w[:, None]] = kept
        mantissa = np.packbits(padded, axis=1).view(">u4").reshape(-1).astype(np.uint32)
        sign = np.unpackbits(signs[a // 8 : -(-(a + w.size) // 8)])[: w.size].astype(np.uint32)
        out[a : a + w.size] = (sign << 31) | (exponent[a : a + w.size].astype(np.uint32) << 23) | mantissa
        bit += count
    return out


def _exponent_compressor(zdict: zstandard.ZstdCompressionDict | None) -> zstandard.ZstdCompressor:
    if zdict is not None:
        return zstandard.ZstdCompressor(level=1, dict_data=zdict, write_dict_id=False)
    if not hasattr(_local, "compressor"):
        _local.compressor = zstandard.ZstdCompressor(level=1)
    return _local.compressor


def _exponent_decompressor(zdict: zstandard.ZstdCompressionDict | None) -> zstandard.ZstdDecompressor:
    if zdict is not None:
        return zstandard.ZstdDecompressor(dict_data=zdict)
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor
