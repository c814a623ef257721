"""The vector cores' row decoders (``DecodeFp8Row`` / ``DecodeFp4Row`` in ``op_kernel/vector_core.h``) as numpy, step
by step, with the table the host binding uploads (``DecodeTables`` in ``host/binding.cpp``, read from its source).

Assumed hardware behaviour (documented, unverified on a 950): the native ``fp8_e4m3fn_t -> float`` Cast gives the
exact value of every code (NaN for 0x7F / 0xFF, subnormals kept); ``Gather`` reads ``src`` at byte offsets; fp32
``Mul`` is IEEE without flushing subnormals; ``float -> bfloat16_t`` CAST_RINT rounds to nearest even.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from .headers import Headers
from .memory import f32_to_bf16

BINDING = Path(__file__).resolve().parent.parent / "host" / "binding.cpp"
D = 512


def decode_table(headers: Headers, binding_text: str | None = None) -> np.ndarray:
    """The e2m1 code -> value table of ``DecodeTables``: its magnitudes literal, negated for codes with bit 3."""
    text = binding_text if binding_text is not None else BINDING.read_text()
    body = text[text.index("at::Tensor DecodeTables("):]
    literal = re.search(r"magnitudes\{([^}]*)\}", body)
    if literal is None or "(code & 8) ? -m : m" not in body:
        raise ValueError("binding.cpp: DecodeTables no longer has the magnitudes literal and sign rule the model reads")
    magnitudes = [float(x.strip().rstrip("f")) for x in literal.group(1).split(",")]
    size = headers["kDecodeTableFloats"]
    codes = np.arange(size)
    mags = np.array(magnitudes, np.float32)[codes & 7]
    return np.where(codes & 8, -mags, mags).astype(np.float32)


def offset_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``LoadDecodeTables``' byte offsets: scale of element i for tiles of 32 and 16, and the FP4 interleave."""
    i = np.arange(D, dtype=np.int32)
    half_index = i >> 1
    interleave = (((i - (half_index << 1)) << 8) + half_index) << 2
    return (i >> 5) << 2, (i >> 4) << 2, interleave


def _gather(src: np.ndarray, byte_offsets: np.ndarray) -> np.ndarray:
    return src[byte_offsets.astype(np.int64) // src.itemsize]


def _e4m3_to_f32(codes: np.ndarray) -> np.ndarray:
    return torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()


def _scale_to_bf16(values: np.ndarray, tile_scales: np.ndarray, tile_offsets: np.ndarray) -> np.ndarray:
    scales = _gather(tile_scales, tile_offsets)
    return f32_to_bf16(values * scales)


def decode_fp8_row(row: np.ndarray) -> np.ndarray:
    """528 bytes (512 e4m3 | 16 e8m0) -> 512 bf16 bits, as DecodeFp8Row."""
    values = _e4m3_to_f32(row[:D])
    scale_bits = row[D:D + D // 32].astype(np.uint32) << np.uint32(23)  # u8 -> u32 Cast, ShiftLeft 23
    return _scale_to_bf16(values, scale_bits.view(np.float32), offset_tables()[0])


def decode_fp4_row(row: np.ndarray, table: np.ndarray) -> np.ndarray:
    """288 bytes (256 e2m1 pairs | 32 e4m3) -> 512 bf16 bits, as DecodeFp4Row."""
    nibbles = np.empty(D, np.uint32)
    nibbles[:D // 2] = row[:D // 2].astype(np.uint32)           # u8 -> u32 Cast
    nibbles[D // 2:] = nibbles[:D // 2] >> np.uint32(4)           # high nibbles
    nibbles[:D // 2] = nibbles[:D // 2] - (nibbles[D // 2:] << np.uint32(4))  # low nibbles
    nibbles = nibbles << np.uint32(2)                              # byte offsets into the table
    codes = _gather(nibbles, offset_tables()[2])                   # element order
    values = _gather(table, codes)
    tile_scales = _e4m3_to_f32(row[D // 2:D // 2 + D // 16])
    return _scale_to_bf16(values, tile_scales, offset_tables()[1])
