"""Watching one Python-path call and describing it for ``callpath.cpp``: what it allocates, what it launches
with which parameters, and what it returns.

Every kernel parameter must be a constant of the call signature or the address of one of the call's tensors
(an input argument or a buffer the call allocated) plus a fixed offset; anything else refuses the entry, and
the signature keeps the Python path: a torch op that is neither an allocation nor a view (a copy, a fill:
GPU work the entry would not repeat), a launch that did not go through a compiled kernel's launcher, an
address that lies in no tensor of the call, or in two, a kernel needing launch features the entry does not
set (clusters, programmatic dependent launch, scratch memory), or a parameter list that disagrees with the
compiled kernel's own (its PTX entry's parameters, read back).
"""

from __future__ import annotations

import math
import re
import struct
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)
_PACK = {"i1": "<b", "i8": "<b", "u1": "<B", "u8": "<B", "i16": "<h", "u16": "<H", "i32": "<i", "u32": "<I",
         "i64": "<q", "u64": "<Q", "fp32": "<f", "f32": "<f", "fp64": "<d"}
_PTX_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}
_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.[busf](8|16|32|64)\b[^,\n]*?(?:\[(\d+)\])?\s*(?:,|$)",
                        re.M)


class Refused(Exception):
    """The watched call cannot become an entry (the message says why)."""


class Watch(TorchDispatchMode):
    """The torch ops of a watched call: its allocations kept, anything but views and output poisoning refused."""

    def __init__(self):
        super().__init__()
        self.allocations: list[torch.Tensor] = []
        self.refused: Optional[str] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocations.append(out)
        elif func is torch.ops.aten.fill_.Scalar and isinstance(args[1], float) and math.isnan(args[1]) and \
                any(args[0].data_ptr() == a.data_ptr() and args[0].numel() == a.numel() for a in self.allocations):
            pass  # poisoning a fresh buffer (anymla.buffers' test mode): the entry poisons when asked to
        elif not func.is_view and self.refused is None:
            self.refused = f"the call runs {func} (GPU work an entry does not repeat)"
        return out


def ptx_param_sizes(ptx: str) -> list[int]:
    """The byte size of each parameter of the (one) kernel entry in ``ptx``, in order."""
    start = ptx.find(".entry")
    if start < 0:
        raise Refused("the compiled kernel has no PTX entry to check its parameters against")
    body = ptx[ptx.index("(", start) + 1:ptx.index(")", start)]
    return [_PTX_BYTES[bits] * (int(count) if count else 1) for bits, count in _PTX_PARAM.findall(body)]


def expand_signature(signature: list, tensordesc_meta) -> list:
    """The kernel's parameter types as Triton's launcher sees them: host tensor descriptors expanded (the
    encoded descriptor, its shape as i32 and its strides as i64, where the kernel takes it by TMA)."""
    out, metas = [], list(tensordesc_meta or ())
    for ty in signature:
        if isinstance(ty, str) and ty.startswith("tensordesc"):
            if not metas or metas[0] is None:
                raise Refused("a tensor descriptor the kernel does not take by TMA")
            metas.pop(0)
            ndim = ty[ty.index("[") + 1:ty.index("]")].count(",") + 1
            out += ["nvTmaDesc"] + ["i32"] * ndim + ["i64"] * ndim
        else:
            out.append(ty)
    return out


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s address to just past its last element."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


class Places:
    """Where an address lies: in which allocation or input argument, at which offset."""

    def __init__(self, inputs: dict, allocations: list):
        self.spans = [(True, j, a.data_ptr(), a.untyped_storage().nbytes()) for j, a in enumerate(allocations)]
        self.spans += [(False, i, t.data_ptr(), _extent(t)) for i, t in inputs.items()]

    def of(self, address: int) -> tuple[bool, int, int]:
        found = {(alloc, i, address - base) for alloc, i, base, size in self.spans
                 if base <= address < base + max(size, 1)}
        if len(found) != 1:
            raise Refused(f"an address lies in {'no tensor' if not found else 'two tensors'} of the call")
        return found.pop()


def _pointer(value) -> int:
    if value is None:
        return 0
    return value.data_ptr() if isinstance(value, torch.Tensor) else int(value)


def _descriptor_bytes(desc) -> bytes:
    """The 128 bytes of an encoded ``CUtensorMap``: Triton's PyCUtensorMap object keeps it last in itself,
    aligned (its size is the Python object header rounded up to the map's alignment, plus the map)."""
    import ctypes
    size = type(desc).__basicsize__
    return ctypes.string_at(id(desc) + size - 128, 128)


def launch_spec(direct, grid: tuple, args: list, places: Places) -> tuple:
    """``(launch, desc_input)`` for ``callpath.cpp``'s register: ``launch`` is (function, grid, block, shared,
    parameter bytes, patches); ``desc_input`` the argument whose address the kernel's descriptors encode
    (None: none)."""
    kernel = direct.kernel
    md = kernel.metadata
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False) or \
            getattr(md, "launch_cooperative_grid", False):
        raise Refused("the kernel launches with clusters, PDL or a cooperative grid")
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise Refused("the kernel takes scratch memory")
    types = expand_signature(list(kernel.src.signature.values()), getattr(md, "tensordesc_meta", None))
    descs = [args[p] for p in direct.positions]
    values = direct.encoded(list(args))
    if len(values) != len(types):
        raise Refused("the launch's arguments do not follow the kernel's signature")
    params, patches, desc_input, seen = [], [], None, 0
    for ty, v in zip(types, values):
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            address = _pointer(v)
            if address:
                alloc, index, offset = places.of(address)
                patches.append((len(params), alloc, index, offset))
            params.append(struct.pack("<Q", address))
        elif ty == "nvTmaDesc":
            alloc, index, _ = places.of(descs[seen].base.data_ptr())
            seen += 1
            if alloc or desc_input not in (None, index):
                raise Refused("tensor descriptors over an allocation, or over two inputs")
            desc_input = index
            params.append(_descriptor_bytes(v))
        elif ty in _PACK:
            try:
                params.append(struct.pack(_PACK[ty], v))
            except struct.error:
                raise Refused(f"a {ty} parameter of value {v!r}") from None
        else:
            raise Refused(f"a parameter of type {ty}")
    params += [bytes(8), bytes(8)]  # the global and profile scratch pointers Triton appends (none needed)
    if [len(p) for p in params] != ptx_param_sizes(kernel.asm["ptx"]):
        raise Refused("the parameters disagree with the compiled kernel's PTX entry")
    launch = (int(kernel.function), tuple(int(g) for g in grid), 32 * md.num_warps, md.shared, params, patches)
    return launch, desc_input


def output_specs(outputs: tuple, allocations: list) -> list:
    """Each output as (allocation, sizes, strides, storage offset), sizes None where it is the allocation."""
    specs = []
    for t in outputs:
        match = [j for j, a in enumerate(allocations) if isinstance(t, torch.Tensor) and
                 a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and a.dtype == t.dtype]
        if len(match) != 1:
            raise Refused("an output is not one of the call's allocations")
        a = allocations[match[0]]
        whole = t.shape == a.shape and t.stride() == a.stride() and t.storage_offset() == a.storage_offset()
        specs.append((match[0], None, None, 0) if whole else
                     (match[0], tuple(t.shape), tuple(t.stride()), t.storage_offset()))
    return specs
