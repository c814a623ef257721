"""Watching one Python-path call and describing it for ``callpath.cpp``: what it allocates, what it launches
with which parameters, and what it returns.

Every kernel parameter must be a constant of the call signature or the address of one of the call's tensors
(an input argument or a buffer the call allocated) plus a fixed offset; anything else refuses the entry, and
the signature keeps the Python path: a torch op that is neither an allocation, a view nor one of the ops an
entry runs (a copy, a fill: GPU work the entry would not repeat), a launch that did not go through a compiled kernel's launcher, an
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
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_aten = torch.ops.aten
_ALLOCATIONS = (_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default)
# ATen ops an entry runs itself (through the dispatcher, from C++): the GEMMs of the MLA layer's step.
OPS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.bmm.out, _aten.add.Tensor)
_PACK = {"i1": "<b", "i8": "<b", "u1": "<B", "u8": "<B", "i16": "<h", "u16": "<H", "i32": "<i", "u32": "<I",
         "i64": "<q", "u64": "<Q", "fp32": "<f", "f32": "<f", "fp64": "<d"}
_PTX_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}
_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.[busf](8|16|32|64)\b[^,\n]*?(?:\[(\d+)\])?\s*(?:,|$)",
                        re.M)


class Refused(Exception):
    """The watched call cannot become an entry (the message says why)."""


class Watch(TorchDispatchMode):
    """The torch ops of a watched call, in order with its launches (``events``, which the Triton launcher's
    recorder appends to too): allocations and the ops an entry runs (:data:`OPS`) kept, anything but views
    and output poisoning refused."""

    def __init__(self):
        super().__init__()
        self.events: list = []
        self.allocations: list[torch.Tensor] = []
        self.poisoned: set = set()  # the allocations anymla.buffers poisoned (by number)
        self.refused: Optional[str] = None

    def refuse(self, why: str) -> None:
        self.refused = self.refused or why

    def call(self, fn, args: tuple):
        """``fn(*args)`` (another backend's own form of a nested call: FlashMLA called as it would be), its ops
        unwatched (they are the backend's), kept as one step whose result tuple becomes values."""
        with _disable_current_modes():
            out = fn(*args)
        self.events.append(("call", fn, args, out))
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ALLOCATIONS:
            self.allocations.append(out)
            self.events.append(("alloc", out))
        elif func in OPS:
            self.events.append(("op", func, args, kwargs, out))
        elif func is _aten.fill_.Scalar and isinstance(args[1], float) and math.isnan(args[1]) and \
                any(args[0].data_ptr() == a.data_ptr() and args[0].numel() == a.numel() for a in self.allocations):
            # poisoning a fresh buffer (anymla.buffers' test mode): the entry poisons it too when asked to
            self.poisoned.update(i for i, a in enumerate(self.allocations) if a.data_ptr() == args[0].data_ptr())
        elif not func.is_view:
            self.refuse(f"the call runs {func} (GPU work an entry does not repeat)")
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


INPUT, VALUE, CONSTANT = 0, 1, 2  # a tensor's source (callpath.cpp's Source)


class Places:
    """Where a call's tensors and addresses lie: in an input argument, a tensor an earlier step made (a
    value), or a tensor the entry holds (a constant: a layer's weights and tables)."""

    def __init__(self, inputs: dict, constants: list):
        self.inputs, self.values, self.constants = inputs, [], list(constants)

    def _spans(self):
        for i, t in self.inputs.items():
            yield INPUT, i, t, t.data_ptr(), _extent(t)
        for kind, tensors in ((VALUE, self.values), (CONSTANT, self.constants)):
            for j, t in enumerate(tensors):
                yield kind, j, t, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()

    def of(self, address: int) -> tuple[int, int, int]:
        """(source, index, byte offset) of the tensor ``address`` lies in."""
        found = sorted({(kind, i, address - base) for kind, i, _, base, size in self._spans()
                        if base <= address < base + max(size, 1)})
        return self._one(found, "an address")

    @staticmethod
    def _one(found: list, what: str):
        """The one place found; values may share a storage (an op writing into an allocation returns it),
        and then the first made is taken."""
        if not found or (len(found) > 1 and any(f[0] != VALUE for f in found)):
            raise Refused(f"{what} of the call lies in {'no tensor' if not found else 'two tensors'} it knows")
        return found[0]

    def ref(self, t: torch.Tensor) -> tuple:
        """``t`` as (source, index, sizes, strides, storage offset): a view of a source's storage, sizes None
        where it is the source itself."""
        storage = t.untyped_storage().data_ptr()
        found = [(kind, i, s) for kind, i, s, _, _ in self._spans() if s.dtype == t.dtype and
                 s.untyped_storage().data_ptr() == storage]
        kind, i, s = self._one(found, "a tensor")
        same = s.shape == t.shape and s.stride() == t.stride() and s.storage_offset() == t.storage_offset()
        return (kind, i, None, None, 0) if same else (kind, i, tuple(t.shape), tuple(t.stride()), t.storage_offset())


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
                kind, index, offset = places.of(address)
                if kind != CONSTANT:  # a constant's address is the parameter's for good
                    patches.append((len(params), kind, index, offset))
            params.append(struct.pack("<Q", address))
        elif ty == "nvTmaDesc":
            kind, index, _ = places.of(descs[seen].base.data_ptr())
            seen += 1
            if kind != INPUT or desc_input not in (None, index):
                raise Refused("tensor descriptors over a value or constant, or over two inputs")
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


def call_spec(fn, args: tuple, out, places: Places) -> tuple:
    """A call step for ``callpath.cpp``: ("call", fn, its arguments, each ("t", tensor reference) or ("o", the
    object itself), how many tensors it returns)."""
    if not isinstance(out, tuple) or not all(isinstance(t, torch.Tensor) for t in out):
        raise Refused("a nested call returned other than a tuple of tensors")
    return ("call", fn, [("t", places.ref(a)) if isinstance(a, torch.Tensor) else ("o", a) for a in args], len(out))


def op_spec(func, args: tuple, kwargs: dict, places: Places) -> tuple:
    """An ATen op's step for ``callpath.cpp``: ("op", name, overload, its arguments in the schema's order,
    each ("t", tensor reference) or ("v", constant))."""
    specs = []
    for i, a in enumerate(func._schema.arguments):
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name, a.default_value)
        if isinstance(v, torch.Tensor):
            specs.append(("t", places.ref(v)))
        elif v is None or isinstance(v, (bool, int, float)):
            specs.append(("v", v))
        else:
            raise Refused(f"{func}'s argument {a.name} is a {type(v).__name__}")
    return ("op", func._schema.name, func._schema.overload_name, specs)
