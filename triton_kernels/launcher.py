"""Launching a compiled Triton kernel without Triton's per-call Python work.

``fn[grid](*args)`` binds every argument, computes the specialization key, looks the compiled kernel up and
only then launches: tens of microseconds of host time per call, more than many decode kernels take on the
GPU. A :class:`Launcher` belongs to one launch plan, so the argument signature is fixed; what Triton's
specialization can still vary on between calls of that signature is which pointers are 16-byte aligned.
Its first call with an alignment pattern goes through ``fn[grid]`` (compiling if needed) and keeps the
compiled kernel; later calls hand the arguments straight to that kernel's launcher. The argument list itself
is mostly fixed by the plan too (strides, sizes, constexprs): :meth:`Launcher.bind` keeps the first call's
list and fills in only what a call brings (its tensors, float scalars and tensor-memory descriptors). The
compiled kernel gets each tensor as its address and each descriptor encoded once (:class:`_Direct`), which
spares Triton's C launcher a driver query a tensor and an encoding a descriptor on every launch.

Launch hooks (profilers read launches there) are handed to the compiled kernel as Triton's own launch hands
them, with the launch metadata computed only while one is installed. There is no fast path (every call
goes through ``fn[grid]``) under Triton's interpreter and with a Triton older than 3.4 (no ``triton.knobs``).
"""

from __future__ import annotations

import copy
import functools

import torch


@functools.lru_cache(maxsize=None)
def _knobs():
    """Triton's runtime knobs (where launch hooks live), or None for a Triton without them (< 3.4)."""
    import triton
    knobs = getattr(triton, "knobs", None)
    return None if knobs is None else knobs.runtime


def _installed(hook) -> bool:
    """Whether a launch hook is installed. Triton 3.6+ keeps its hooks in an (empty) ``HookChain``, older ones
    in a plain attribute that is None when unset."""
    return hook is not None and bool(getattr(hook, "calls", True))


@functools.lru_cache(maxsize=None)
def _driver():
    """The active driver's current-device and current-stream functions (as Triton's own launch asks them)."""
    import triton
    driver = triton.runtime.driver.active
    return driver.get_current_device, driver.get_current_stream


_SEEN: set = set()  # ids of the compiled kernels any Launcher has kept (Triton keeps the kernels alive)
# anymla.callpath's record of the call it watches, while it watches one: each launch's (compiled kernel as a
# _Direct, or None where there is none or a launch hook took it, grid, argument list before descriptor encoding).
RECORDER: list = [None]


def compiled_kernels() -> int:
    """Distinct compiled kernels launched through a :class:`Launcher` in this process."""
    return len(_SEEN)


def _per_call(a) -> bool:
    """Whether an argument is one a call brings: a tensor (or the None of an absent optional one), a float
    scalar, or a tensor-memory descriptor. Integers and constexprs are the plan's."""
    return a is None or isinstance(a, (torch.Tensor, float)) or (hasattr(a, "block_shape") and hasattr(a, "base"))


class Launcher:
    """``fn`` launched with fixed options (``num_warps``, ``maxnreg``, ...) for the calls of one plan."""

    def __init__(self, fn, **options):
        self.fn = fn
        self.options = options
        self._pointers = None  # positions of the tensor arguments (fixed by the plan's signature)
        self._compiled = {}  # alignment pattern -> the compiled kernel (a _Direct)
        self._template = None  # the plan's argument list, its per-call slots emptied
        self._slots = ()  # where a call's own values go in them

    def bind(self, grid: tuple, values: tuple, full) -> None:
        """Launch with ``values``, the call's own arguments in kernel order (see :func:`_per_call`), put into
        the plan's argument list. ``full()`` builds that whole list, with every tensor as the kernel is
        compiled for (dtype, shape, strides); a value only has to be a tensor at the same address (a call
        may pass a cache as it came where the list holds its byte view). ``full`` is called on the first
        call, and when a call's alignment pattern has no compiled kernel yet."""
        if self._template is not None:
            args = self._template.copy()
            for i, v in zip(self._slots, values):
                args[i] = v
            if self._launch_compiled(grid, args, owned=True):
                return
        args = full()
        if self._template is None:
            self.adopt(args, values)
        self(grid, args)

    def adopt(self, args: list, values: tuple) -> None:
        """Keep ``args`` (a call's whole list) as the template whose per-call entries are ``values``."""
        slots = [i for i, a in enumerate(args) if _per_call(a)]
        if len(slots) != len(values) or not all(_same_value(args[i], v) for i, v in zip(slots, values)):
            raise RuntimeError(f"{getattr(self.fn, '__name__', self.fn)}: the per-call values do not match the "
                               "argument list's tensor, float and descriptor slots")
        # The slots are overwritten by every call: emptied here, so the plan keeps no call's tensors alive.
        taken = set(slots)
        self._template = [None if i in taken else a for i, a in enumerate(args)]
        self._slots = slots

    def _alignment(self, args) -> int:
        bits = 0
        for i in self._pointers:
            bits = (bits << 1) | (args[i].data_ptr() % 16 == 0)
        return bits

    def _launch_compiled(self, grid: tuple, args: list, owned: bool = False) -> bool:
        """Launch the kernel compiled for ``args``' alignment pattern, if there is one (True when launched).
        ``owned``: ``args`` is this call's own list, which may be overwritten (unless a hook needs it)."""
        if not self._compiled:
            return False
        knobs = _knobs()
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        hooked = _installed(enter) or _installed(leave)
        # Tensors go to the compiled kernel as their addresses: its C launcher takes an int as the pointer
        # itself, where for a tensor it calls data_ptr() and asks the driver to check the address
        # (cuPointerGetAttribute, ~1-2 µs a tensor). The addresses come from live tensors of this call.
        bits, flat = 0, args if owned and not hooked else list(args)
        for i in self._pointers:
            ptr = flat[i].data_ptr()
            bits = (bits << 1) | (ptr % 16 == 0)
            flat[i] = ptr
        direct = self._compiled.get(bits)
        if direct is None:  # (an owned list, now holding addresses, is dropped by bind)
            return False
        kernel, run = direct.kernel, direct.run
        device, stream = _driver()
        s = stream(device())
        meta, handed = None, flat
        if hooked:  # hooks read the launch metadata, which wants the tensors themselves
            meta, handed, run = kernel.launch_metadata(grid, s, *args), args, kernel.run
        else:
            handed = direct.encoded(flat)
        run(grid[0], grid[1], grid[2], s, kernel.function, kernel.packed_metadata, meta, enter, leave, *handed)
        if RECORDER[0] is not None:
            RECORDER[0].append((None if hooked else direct, grid, flat))
        return True

    def __call__(self, grid: tuple, args: list) -> None:
        """Launch over ``grid`` (three ints) with ``args``: every kernel parameter in order, constexprs too,
        each tensor as the kernel is compiled for."""
        if self._launch_compiled(grid, args):
            return
        kernel = self.fn[grid](*args, **self.options)
        direct = None
        if hasattr(kernel, "packed_metadata") and _knobs() is not None:  # not under the interpreter
            if self._pointers is None:
                self._pointers = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            direct = self._compiled[self._alignment(args)] = _Direct(kernel)
            _SEEN.add(id(kernel))
        if RECORDER[0] is not None:
            RECORDER[0].append((direct, grid, list(args)))


class _Direct:
    """A compiled kernel and how to call its launcher. Where the kernel takes host tensor-memory descriptors,
    Triton's launcher encodes each one again (cuTensorMapEncodeTiled) on every launch; this one encodes a
    descriptor object once and hands its encoding to the launcher underneath Triton's descriptor wrapper while
    the same object comes back (a plan's :class:`LatestDescriptors` returns one object per cache). Found by
    looking into that wrapper (Triton 3.6 and 3.7 keep the inner launcher, the descriptors' positions and
    their metadata in its closure); where it is not there, every launch goes through Triton's own path."""

    def __init__(self, kernel):
        self.kernel, self.run, self.positions, self._cache = kernel, kernel.run, (), {}
        wrapper = getattr(kernel.run, "launch", None)
        code = getattr(wrapper, "__code__", None)
        needed = ("launcher", "tensordesc_indices", "tensordesc_meta")
        if code is None or not all(n in code.co_freevars for n in needed) or \
                "make_tensordesc_arg" not in wrapper.__globals__:
            return
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in wrapper.__closure__)))
        self.run = copy.copy(kernel.run)
        self.run.launch = cells["launcher"]
        self.positions = sorted(cells["tensordesc_indices"])
        self._metas = list(cells["tensordesc_meta"])
        self._expand = wrapper.__globals__["make_tensordesc_arg"]

    def encoded(self, args: list) -> list:
        """``args`` with each descriptor replaced by its encoding (what Triton's wrapper would hand on)."""
        if not self.positions:
            return args
        out, start = [], 0
        for pos, meta in zip(self.positions, self._metas):
            desc = args[pos]
            # the latest descriptor a position saw (the one its plan's LatestDescriptors keeps alive anyway)
            kept = self._cache.get(pos)
            if kept is None or kept[0] is not desc:
                kept = self._cache[pos] = (desc, self._expand(desc, meta))
            out += args[start:pos]
            out += kept[1]
            start = pos + 1
        out += args[start:]
        return out


def _same_value(listed, value) -> bool:
    """Whether a call's ``value`` stands for the argument list's entry: itself, or a tensor at its address."""
    if listed is value:
        return True
    return isinstance(listed, torch.Tensor) and isinstance(value, torch.Tensor) and \
        listed.data_ptr() == value.data_ptr()


class LatestDescriptors:
    """Tensor-memory (TMA) descriptors of the latest cache seen, made by ``make(cache)``: a serving engine
    passes the same cache to every call, so they are made once rather than per call."""

    def __init__(self, make):
        self.make, self.key, self.value = make, None, None

    def __call__(self, kv: torch.Tensor):
        key = (kv.data_ptr(), kv.shape, kv.stride())
        if key != self.key:
            self.key, self.value = key, self.make(kv)
        return self.value
