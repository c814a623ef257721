"""Whether the ``mma_v2`` kernels of this folder take a call of the Triton tier (no reasons: they do).

They are written for the NVIDIA GPUs whose matrix instruction is ``mma.sync``: sm_80 (A100), sm_86 / sm_89
(RTX 30xx / 40xx, A10, L40S) and sm_120 (RTX 50xx). A Hopper GPU runs them only as those GPUs' stand-in: with
``DISABLE_MMA_V3=1`` (Triton's ``tl.dot`` on mma.sync too) and the Hopper kernels off, which is what
``python -m anymla.bench --portable --mma-sync`` measures. sm_100 keeps the portable kernel (its ``tl.dot``
has Blackwell's own matrix instructions). They are there because they were measured faster than the portable
kernel on the stand-in, 1.6-2.0x on every canonical shape they serve (``NOTES.md``, run 125).
``tuning.forced(mma_v2=False)`` or ``ANYMLA_MMA_V2=0`` switches them off; ``tuning.forced(mma_v2=True)`` insists
on them (an error naming the reasons where a call does not fit).
"""

from __future__ import annotations

import torch
import triton

from anymla.kvcache import KVCacheFormat

from .. import runtime
from ..tuning import TileConfig, forced_mma_v2, forced_tile
from .launch import HEADS, choose_tile, rows_aligned

# Query rows (heads a token; in dense decoding s_q x h_q a request) from which they take a call: their programs
# are 64 rows, so fewer waste rows; below this the portable kernel's 16- and 32-row tiles serve (the mma_v2
# kernels are measured at 64 and 128 heads only).
FEWEST_ROWS = 33


def device_reasons(device: torch.device) -> list[str]:
    """Why they do not run on ``device`` at all (empty: it is theirs)."""
    if forced_mma_v2() is False:
        return ["turned off (tuning.forced(mma_v2=False), or ANYMLA_MMA_V2=0)"]
    if device.type != "cuda" or runtime.rocm():
        return ["they run on NVIDIA GPUs only"]
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return [f"sm_{major}{minor}: they need sm_80 or newer"]
    if major == 9 and not runtime.mma_v3_disabled():
        return ["an sm_90 GPU has wgmma: they run there only as the mma.sync stand-in (DISABLE_MMA_V3=1)"]
    if major == 10:
        return ["sm_100: the portable kernel's tl.dot has Blackwell's matrix instructions there"]
    if not runtime.gluon_ampere():
        return [f"Triton {triton.__version__}'s Gluon is not a version they were checked with (3.6, 3.7)"]
    if forced_tile() is not None:
        return ["a tile of the portable kernel is forced"]
    return []


def _heads_reasons(rows: int, what: str = "heads a token") -> list[str]:
    if rows < FEWEST_ROWS and not forced_mma_v2():
        return [f"{rows} {what}: fewer than {FEWEST_ROWS}, where the portable kernel's smaller tiles waste fewer "
                f"rows than their 64-row programs"]
    return []


def prefill_reasons(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> list[str]:
    """Why the mma_v2 prefill kernel does not serve ``flash_mla_sparse_fwd`` with q ``[s_q, h_q, d_qk]`` and kv
    ``[s_kv, h_kv, d_qk]`` as the kernel reads them, on a device of theirs (empty: it does)."""
    reasons = _heads_reasons(q.shape[1])
    if kv.shape[1] != 1:
        reasons.append(f"h_kv {kv.shape[1]}: it takes one kv head")
    if q.shape[-1] not in (512, 576) or d_v != 512:
        reasons.append(f"d_qk {q.shape[-1]}, d_v {d_v}: it takes d_qk 512 or 576 and d_v 512")
    if q.dtype != kv.dtype or q.dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"q {q.dtype} and kv {kv.dtype}: it takes bf16 or fp16, the same for both")
    if kv.data_ptr() % 16 or not (rows_aligned(q) and rows_aligned(kv)):
        reasons.append("q's or kv's rows are not 16-byte aligned (it copies them 16 bytes at a time)")
    return reasons


def decode_reasons(p) -> list[str]:
    """Why the mma_v2 decoding kernel does not serve the sparse decoding call ``p`` (a validated SparseDecode) on
    a device of theirs (empty: it does): a V3.2 FP8 cache alone, rows back to back in 16-byte aligned blocks."""
    reasons = _heads_reasons(p.q.shape[2])
    if p.fmt is not KVCacheFormat.V32_FP8 or p.extra_k_cache is not None:
        reasons.append(f"a {p.fmt.name} cache{' with an extra cache' if p.extra_k_cache is not None else ''}: it "
                       "takes a V3.2 FP8 cache alone")
    elif p.k_cache.stride(1) != p.k_cache.shape[-1] or p.k_cache.stride(0) % 16 or p.k_cache.data_ptr() % 16:
        reasons.append("the cache's rows are not back to back in 16-byte aligned blocks")
    if p.q.dtype != torch.bfloat16:
        reasons.append(f"q {p.q.dtype}: it takes bf16")
    if not rows_aligned(p.q):
        reasons.append("q's rows are not 16-byte aligned (it copies them 16 bytes at a time)")
    return reasons


def dense_reasons(p) -> list[str]:
    """Why the mma_v2 dense decoding kernel does not serve the call ``p`` (a validated DenseDecode) on a device
    of theirs (empty: it does): one kv head, d_qk 512 or 576, d_v 512, rows 16-byte aligned, and at least
    FEWEST_ROWS query rows a request (``s_q x h_q``: its programs are 64 of them)."""
    b, s_q, h_q, d = p.q.shape
    reasons = _heads_reasons(s_q * h_q, "query rows a request")
    if p.k_cache.shape[2] != 1:
        reasons.append(f"h_kv {p.k_cache.shape[2]}: it takes one kv head")
    if d not in (512, 576) or p.d_v != 512:
        reasons.append(f"d_qk {d}, d_v {p.d_v}: it takes d_qk 512 or 576 and d_v 512")
    if p.k_cache.data_ptr() % 16 or not (rows_aligned(p.q) and rows_aligned(p.k_cache)):
        reasons.append("q's or the cache's rows are not 16-byte aligned (it copies them 16 bytes at a time)")
    return reasons


def programs(device: torch.device) -> TileConfig:
    """The prefill and dense decoding kernels' programs as the split choice counts them: 64 rows, the keys a
    block of their tile on ``device`` (at d_qk 576), 8 warps, one program a multiprocessor."""
    block_n, _ = choose_tile(576, runtime.max_shared_memory(device))
    return TileConfig(HEADS, block_n, 8, 1)


def decode_programs(device: torch.device) -> TileConfig:
    """The decoding kernel's programs as the split choice counts them: 64 heads, its keys a block on ``device``,
    8 warps, its latent tiles as the stages, one program a multiprocessor (~250 registers x 256 threads)."""
    from .decode_launch import choose_decode_tile
    block_n, latent_tiles = choose_decode_tile(runtime.max_shared_memory(device), runtime.native_fp8(device))
    return TileConfig(HEADS, block_n, 8, latent_tiles)


def decide(hopper: bool, device: torch.device, call_reasons) -> tuple[bool, list[str], list[str]]:
    """``(whether an mma_v2 kernel runs, the device's reasons against it, the call's)`` for a plan whose Hopper
    kernel runs (``hopper``: then none) or not; ``call_reasons()`` is asked only on a device of theirs."""
    if hopper:
        return False, [], []
    here = device_reasons(device)
    call = [] if here else call_reasons()
    return use(here, call), here, call


def use(device: list[str], call: list[str]) -> bool:
    """Whether to launch an mma_v2 kernel, given the device's and the call's reasons against it; a forced one
    that cannot run raises with every reason."""
    if (device or call) and forced_mma_v2():
        raise ValueError("the mma_v2 kernel was forced, but: " + "; ".join(device + call))
    return not (device or call)


def running(tile: str, hopper_reasons: list[str], num_splits: int, op: str = "sparse") -> str:
    """``explain()``'s kernel line where it runs (``tile``: its keys a block and stages): why not the Hopper
    kernel, and the split count."""
    return (f"the mma_v2 {op} kernel (triton_kernels/ampere/: {HEADS} query rows a program, {tile}, 8 warps); "
            "not the Hopper one: " + "; ".join(hopper_reasons) +
            (f"; {num_splits} splits along the keys" if num_splits > 1 else ""))


def not_running(device: list[str], call: list[str]) -> str:
    """``explain()``'s words where it does not run: why, on a device of theirs ("" elsewhere: nothing to say)."""
    return "" if device or not call else "; not the mma_v2 one: " + "; ".join(call)
