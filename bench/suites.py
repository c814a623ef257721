"""Named suites of benchmark shapes, shapes given on the command line, and the inputs each shape gets.

A :class:`Case` is one shape of one op (``sparse_prefill``, ``sparse_decode`` or ``dense_decode``) with its
parameters. :func:`build_inputs` turns it into the public function and keyword arguments of one call,
drawn by :mod:`anymla.testing`'s generators (fresh random data, NaN in every row the call must not read),
so every backend of a case runs on the very same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import anymla
from anymla.kvcache import KVCacheFormat
from anymla.testing import dense_decode_inputs, prefill_inputs, sparse_decode_inputs

# Parameters of each op with their defaults; None marks a parameter every shape must give.
PARAMETERS: dict[str, dict] = {
    "sparse_prefill": {"s_q": None, "h_q": None, "d_qk": 576, "s_kv": None, "topk": None, "h_kv": 1,
                       "sink": False, "topk_length": False},
    "sparse_decode": {"b": None, "s_q": 1, "h_q": None, "s_k": None, "topk": None, "fmt": "V32_FP8", "page": 64,
                      "extra_fmt": "", "extra_topk": 0, "extra_page": 64, "extra_s_k": 0, "varlen": False,
                      "sink": False, "topk_length": False},
    "dense_decode": {"b": None, "s_q": 1, "h_q": None, "h_kv": 1, "s_k": None, "d_qk": 576, "page": 64,
                     "causal": False, "varlen": False, "sink": False},
}


@dataclass
class Case:
    """One benchmark shape: an op, its parameters (defaults filled in) and a readable name."""

    name: str
    op: str
    params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.op not in PARAMETERS:
            raise ValueError(f"op: expected one of {', '.join(PARAMETERS)}, got {self.op!r}")
        unknown = set(self.params) - set(PARAMETERS[self.op])
        if unknown:
            raise ValueError(f"{self.name}: unknown parameter(s) {', '.join(sorted(unknown))} for {self.op} "
                             f"(known: {', '.join(PARAMETERS[self.op])})")
        missing = [k for k, v in PARAMETERS[self.op].items() if v is None and k not in self.params]
        if missing:
            raise ValueError(f"{self.name}: {self.op} needs {', '.join(missing)}")
        self.params = {**PARAMETERS[self.op], **self.params}

    def spec(self) -> str:
        """The ``op:key=val,...`` form of this case (parameters that differ from the defaults)."""
        given = [f"{k}={v}" for k, v in self.params.items() if v != PARAMETERS[self.op][k]]
        return f"{self.op}:{','.join(given)}"


def _fmt(name: str) -> KVCacheFormat:
    try:
        return KVCacheFormat[name]
    except KeyError:
        raise ValueError(f"fmt: expected one of {', '.join(f.name for f in KVCacheFormat)}, got {name!r}") from None


def build_inputs(case: Case, device: torch.device, seed: int = 0) -> tuple[Callable, dict]:
    """The public anymla function of ``case`` and the keyword arguments of one call, on ``device``.

    Decode calls carry one :class:`anymla.FlashMLASchedMeta`, reused by every call of the case (so plans
    are built once, outside any CUDA-graph capture).
    """
    p = case.params
    if case.op == "sparse_prefill":
        args = prefill_inputs(p["s_q"], p["h_q"], p["d_qk"], p["s_kv"], p["topk"], h_kv=p["h_kv"], sink=p["sink"],
                              topk_length=p["topk_length"], device=device, seed=seed)
        return anymla.flash_mla_sparse_fwd, args
    if case.op == "sparse_decode":
        extra = None
        if p["extra_fmt"]:
            extra = dict(fmt=_fmt(p["extra_fmt"]), page=p["extra_page"], s_k=p["extra_s_k"] or p["s_k"],
                         topk=p["extra_topk"], topk_length=p["topk_length"])
        args = sparse_decode_inputs(p["b"], p["s_q"], p["h_q"], p["s_k"], p["topk"], fmt=_fmt(p["fmt"]), page=p["page"],
                                    varlen=p["varlen"], sink=p["sink"], topk_length=p["topk_length"], extra=extra,
                                    device=device, seed=seed)
    else:
        args = dense_decode_inputs(p["b"], p["s_q"], p["h_q"], p["h_kv"], p["s_k"], page=p["page"], d_qk=p["d_qk"],
                                   varlen=p["varlen"], causal=p["causal"], sink=p["sink"], device=device, seed=seed)
    args["tile_scheduler_metadata"], _ = anymla.get_mla_metadata()
    return anymla.flash_mla_with_kvcache, args


def _parse_value(op: str, key: str, text: str):
    default = PARAMETERS[op].get(key)
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{key}: expected true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(default, str):
        if text:
            _fmt(text)
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{key}: expected an integer, got {text!r}") from None


def parse_shape(spec: str) -> Case:
    """A case from ``op:key=val,...`` (e.g. ``sparse_decode:b=2,h_q=64,s_k=256,topk=128,fmt=V41_FP8``)."""
    op, sep, rest = spec.partition(":")
    if not sep or op not in PARAMETERS:
        raise ValueError(f"--shape {spec!r}: expected 'op:key=val,...' with op one of {', '.join(PARAMETERS)}")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in PARAMETERS[op]:
            raise ValueError(f"--shape {spec!r}: {item!r} is not key=value with a key of {op} "
                             f"({', '.join(PARAMETERS[op])})")
        params[key] = _parse_value(op, key, value)
    return Case(spec, op, params)


def _prefill(name, h_q, d_qk, s_q=4096, topk=2048, s_kv=32768):
    return Case(name, "sparse_prefill", dict(s_q=s_q, h_q=h_q, d_qk=d_qk, s_kv=s_kv, topk=topk))


def _sparse_decode(name, b, s_q, h_q, fmt, topk=2048, s_k=32768, **extra):
    return Case(name, "sparse_decode", dict(b=b, s_q=s_q, h_q=h_q, s_k=s_k, topk=topk, fmt=fmt, **extra))


def _dense_decode(name, b, s_q, h_q, s_k, causal=False):
    return Case(name, "dense_decode", dict(b=b, s_q=s_q, h_q=h_q, s_k=s_k, causal=causal))


_V41_EXTRA = dict(extra_fmt="V41_FP4", extra_topk=512, extra_page=64, extra_s_k=8192)
_MODEL1_EXTRA = dict(extra_fmt="MODEL1_FP8", extra_topk=512, extra_page=64, extra_s_k=16384)
_V41_FP8_EXTRA = {**_V41_EXTRA, "extra_fmt": "V41_FP8"}
# Every sparse decoding format (main cache, and extra cache where the format takes one), named as in case names.
_DECODE_FORMATS = (("bf16", "BF16", {}), ("v32", "V32_FP8", {}), ("model1", "MODEL1_FP8", {}),
                   ("model1+model1", "MODEL1_FP8", _MODEL1_EXTRA), ("v41", "V41_FP8", {}),
                   ("v41+fp8", "V41_FP8", _V41_FP8_EXTRA), ("v41+fp4", "V41_FP8", _V41_EXTRA))
TP_HEADS = (128, 64, 16, 8)  # DeepSeek's 128 query heads at tensor-parallel degrees 1, 2, 8 and 16

SUITES: dict[str, list[Case]] = {
    # Small enough for the Triton interpreter on two CPU cores (each call well under a second).
    "quick": [
        _prefill("prefill-d576-h16", 16, 576, s_q=2, topk=128, s_kv=256),
        _prefill("prefill-d512-h64", 64, 512, s_q=2, topk=128, s_kv=256),
        _sparse_decode("sdecode-v32-h16", 2, 1, 16, "V32_FP8", topk=128, s_k=256),
        _sparse_decode("sdecode-v41+fp4-h64", 2, 1, 64, "V41_FP8", topk=128, s_k=256,
                       **{**_V41_EXTRA, "extra_topk": 64, "extra_s_k": 128}),
        _dense_decode("ddecode-h16", 2, 1, 16, 256),
        _dense_decode("ddecode-causal-sq2-h16", 2, 2, 16, 256, causal=True),
    ],
    # The canonical shapes of the three kernel issues (anchors for them: anchors.py).
    "canonical-prefill": [
        _prefill("prefill-v32-h128", 128, 576),
        _prefill("prefill-v4-h64", 64, 512),
    ],
    "canonical-sparse-decode": [
        _sparse_decode("sdecode-v32-b128-sq2-h128", 128, 2, 128, "V32_FP8"),
        _sparse_decode("sdecode-v32-b64-sq1-h64", 64, 1, 64, "V32_FP8"),
        _sparse_decode("sdecode-v41+fp4-b128-h64", 128, 1, 64, "V41_FP8", **_V41_EXTRA),
    ],
    "canonical-dense-decode": [
        _dense_decode("ddecode-b128-h16-sk8192", 128, 1, 16, 8192),
        _dense_decode("ddecode-b128-sq2-h128-sk8192", 128, 2, 128, 8192, causal=True),
        _dense_decode("ddecode-b1-h128-sk32768", 1, 1, 128, 32768),
    ],
    # DeepSeek V3.2 (d_qk 576, V3.2 FP8 cache) and V4-class (d_qk 512, V4.1 FP8 + FP4 extra cache) per TP degree.
    "v32-decode": [_sparse_decode(f"v32-decode-h{h}", 64, 1, h, "V32_FP8") for h in TP_HEADS],
    "v32-prefill": [_prefill(f"v32-prefill-h{h}", h, 576) for h in TP_HEADS],
    "v4-decode": [_sparse_decode(f"v4-decode-h{h}", 64, 1, h, "V41_FP8", **_V41_EXTRA) for h in TP_HEADS],
    "v4-prefill": [_prefill(f"v4-prefill-h{h}", h, 512) for h in TP_HEADS],
    # The calls FlashMLA refuses or serves badly (issue 14): tensor-parallel head counts, which FlashMLA only
    # runs with q padded to 64 heads (sparse), dense decoding at 32 heads, and its own MODEL1 (584 B) benchmark
    # configurations CONFIG1 / CONFIG2.
    "tp": [
        _prefill("tp-prefill-h16-d576", 16, 576),
        _prefill("tp-prefill-h32-d512", 32, 512),
        _prefill("tp-prefill-h32-d576", 32, 576),
        *[_sparse_decode(f"tp-sdecode-v32-b128-h{h}", 128, 1, h, "V32_FP8") for h in (8, 16, 32)],
        _sparse_decode("tp-sdecode-model1-b128-h16", 128, 1, 16, "MODEL1_FP8", **_MODEL1_EXTRA),
        _sparse_decode("tp-sdecode-v41+fp4-b128-h16", 128, 1, 16, "V41_FP8", **_V41_EXTRA),
        _dense_decode("tp-ddecode-b128-h32-sk8192", 128, 1, 32, 8192),  # V3's dense MLA at TP 4
        _sparse_decode("model1-config1-b128-sq2-h64", 128, 2, 64, "MODEL1_FP8", topk=128, s_k=16384, page=256,
                       varlen=True, **{**_MODEL1_EXTRA, "extra_topk": 512}),
        _sparse_decode("model1-config2-b128-sq2-h128", 128, 2, 128, "MODEL1_FP8", topk=128, s_k=16384, page=256,
                       varlen=True, **{**_MODEL1_EXTRA, "extra_topk": 1024}),
    ],
    # Issue 14's byte-floor row: sparse decoding of b 128 single-token queries, top-2048, in every format at the
    # tensor-parallel head counts (each row's floor: the bytes it gathers at the same-run copy rate).
    "tp-formats": [_sparse_decode(f"tpf-sdecode-{tag}-b128-h{h}", 128, 1, h, fmt, **extra)
                   for tag, fmt, extra in _DECODE_FORMATS for h in (8, 16, 32)],
}
# Suites made of other suites: their cases run and are reported under the composite's name.
COMPOSITES: dict[str, tuple] = {
    "canonical": ("canonical-prefill", "canonical-sparse-decode", "canonical-dense-decode"),
    "deepseek": ("v32-decode", "v32-prefill", "v4-decode", "v4-prefill"),
}


def suite_names() -> list[str]:
    return list(SUITES) + list(COMPOSITES)


def suite_cases(name: str) -> list[Case]:
    if name in COMPOSITES:
        return [case for part in COMPOSITES[name] for case in SUITES[part]]
    if name not in SUITES:
        raise ValueError(f"--suite: unknown suite {name!r} (known: {', '.join(suite_names())})")
    return list(SUITES[name])
