"""The compiled call path: a repeated call (or MLA layer step) of a signature already planned, run in C++.

The public functions (and ``MLAAttention.forward``) try :func:`entry_point` first; it returns the call's
outputs when an entry of the call's key exists, and None otherwise, and then the Python path runs (validate,
select, plan, launch). On that path, :func:`record` (:func:`record_step`) watches a call the Triton tier runs
and turns it into an entry (``watch.py`` says when it refuses, ``callpath.cpp`` how an entry runs); a peer
that has its own form of a signature's calls (``Backend.entry``) gives that instead. An entry is the
decision's plan in compiled form, made from what that plan did: no choice is made twice.

Entries are kept per selection scope (the ``backend=`` keyword, :func:`anymla.use_backend` or
``ANYMLA_BACKEND``, scoped settings such as ``tuning.forced``), as decisions are. The entry point is not used
with debug checks on (they read the data every call), while a Triton launch hook is installed (profilers
read launches there) or inside :func:`python_path`; a change of the tuning file or of the backend registry forgets every entry.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Callable, Optional

import torch

from ..debug import debug_enabled
from ..registry import generation
from ..selection import _SETTINGS, _override, _sync_tuning
from . import native
from .watch import Places, Refused, Watch, call_spec, launch_spec, op_spec

DECODE, PREFILL, MLA_STEP = 0, 1, 2  # the ops entries are kept for (a key's first part)
_state: dict = {"stamp": None, "refused": {}, "test_device": False, "hooks": None, "watching": False,
                "watch": None, "owners": set()}
_native_state = native._state
_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("anymla_python_path", default=False)
_scopes: dict = {}  # a selection scope (forced backends, their source, scoped settings), or settings -> its number


def _launch_hooks() -> tuple:
    """``(Triton's runtime knobs, which hold its two launch-hook slots, and the test for an installed hook)``,
    or () for a Triton without them (< 3.4)."""
    from anymla.triton_kernels.launcher import _installed, _knobs
    knobs = _knobs()
    return () if knobs is None else ((knobs, _installed), )


@contextlib.contextmanager
def python_path():
    """Run the calls inside the block on the Python path, as without the extension (comparisons, profiling)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def entry_point(backend) -> Optional[tuple[Callable, int]]:
    """``(call, scope)``: the compiled entry point ``call(op, poison, sched, scope, *args)`` and the number of
    the call's selection scope (its ``backend`` keyword, :func:`anymla.use_backend` context or
    ``ANYMLA_BACKEND``, and scoped settings: a decision is made for one scope, so an entry is kept for one);
    None while calls must take the Python path (see the module's docstring)."""
    mod = _native_state["module"]
    if mod is None or _state["watching"] or _OFF.get() or debug_enabled():
        return None
    hooks = _state["hooks"]
    if hooks is None:
        hooks = _state["hooks"] = _launch_hooks()
    for knobs, installed in hooks:
        if installed(knobs.launch_enter_hook) or installed(knobs.launch_exit_hook):
            return None
    stamp = (_sync_tuning(), generation())
    if stamp != _state["stamp"]:
        mod.clear()
        _state["stamp"] = stamp
    return mod.call, number((*_override(backend), _SETTINGS.get()))


# Entries launch with CUDA's driver: NVIDIA GPUs only (torch's ROCm build calls AMD GPUs "cuda" too).
_NVIDIA = torch.version.hip is None


_ON_NVIDIA: dict = {}  # device -> whether it is an NVIDIA GPU (``torch.device.type`` costs ~0.3 µs a read)


def recordable_on(device) -> bool:
    """Whether calls (and layer steps) on ``device`` can have entries: on an NVIDIA GPU, or, in tests, any
    device while a stand-in for the driver is configured."""
    nvidia = _ON_NVIDIA.get(device)
    if nvidia is None:
        nvidia = _ON_NVIDIA[device] = _NVIDIA and device.type == "cuda"
    return nvidia or _state["test_device"]


def recording(device) -> bool:
    """Whether a call on ``device`` goes through :func:`record`: a layer step is being watched, or the call can
    have an entry. Elsewhere (CPU, AMD, NPU, meta) the public functions run their decision directly."""
    return _state["watching"] or recordable_on(device)


def record(entry: Optional[tuple], decision, op: int, problem, args: tuple, run: Callable):
    """``run()`` (the Python path of ``problem``'s call, after its decision), watched and made an entry where
    it can be; ``entry`` is what :func:`entry_point` returned for this call and ``args`` the call's key
    arguments after its scope. Other backends than the Triton tier give their own form of the calls
    (``Backend.entry``) or none."""
    if _state["watching"] and decision.backend != "triton":
        # inside a watched layer step: a watch sees the Triton tier's launches (through its launcher) and torch
        # ops only; another backend's call becomes a step calling its own form of the call, or, without one,
        # the step keeps the Python path
        own = _own_form(decision, problem)
        if own is not None:
            sched = getattr(problem, "sched", None)
            if sched is not None:  # as the Python path binds it (the step's later calls pass the same object)
                sched.bind(decision.sched_config)
            return _state["watch"].call(own, (sched, *args))
        _state["watch"].refuse(f"its {decision.op} call runs on {decision.backend}, which has no form of its own")
    if not recordable_on(problem.device):
        return run()
    mod = native.module()
    if entry is None:
        if mod is None:
            native.build()  # in the background: this and later calls take the Python path meanwhile
        return run()
    args = (entry[1], *args)
    if id(decision) in _state["refused"] or mod.has(op, args):
        return run()
    if decision.backend != "triton":
        own = _own_form(decision, problem)
        try:
            if own is not None:
                mod.register(op, args, _device_spec(problem.device), (), (), (), -1, 0, decision.sched_config,
                             decision, own)
        except (TypeError, ValueError) as e:  # the extension took no entry: its calls keep the Python path
            _state["refused"][id(decision)] = (decision, f"{decision.shape}: {decision.backend}'s entry: {e!r}")
        return run()
    if decision.plan is None:
        return run()
    result, watch = _watched(run)
    _make(mod, decision, op, args, result, watch, id(decision))
    return result


def _own_form(decision, problem) -> Optional[Callable]:
    """The backend's own form of the decision's calls (``Backend.entry``), or None (also when making it
    failed: that signature's calls then keep the Python path, and :func:`refusals` says why)."""
    try:
        return decision.impl.entry(problem, decision.plan)
    except Exception as e:  # noqa: BLE001
        _state["refused"][id(decision)] = (decision, f"{decision.shape}: {decision.backend}'s entry: {e!r}")
        return None


def number(settings) -> int:
    """A small number standing for ``settings`` (anything hashable) in entries' keys."""
    n = _scopes.get(settings)
    if n is None:
        n = _scopes[settings] = len(_scopes)
    return n


def record_step(entry: Optional[tuple], owner, constants: list, op: int, args: tuple, run: Callable):
    """``run()`` (a layer's step, taking the Python path), watched and made an entry where it can be, like
    :func:`record`: the layer's GEMMs, kernels and attention call in one entry; ``owner`` the layer (its entries
    go when it does), ``constants`` its weights and tables; ``args`` the key arguments after the scope."""
    mod = native.module()
    if entry is None:
        return run()
    args = (entry[1], *args)
    if mod.has(op, args):
        return run()
    # refusals per signature (one that runs other ops, a prefill's say, leaves the others free to have entries)
    key = (op, *((a.shape, a.dtype, a.device, a.stride()) if isinstance(a, torch.Tensor) else a for a in args))
    if key in _state["refused"]:
        return run()
    result, watch = _watched(run)
    if id(owner) not in _state["owners"]:
        _state["owners"].add(id(owner))
        weakref.finalize(owner, _forget, id(owner))
    _make(mod, None, op, args, (result,), watch, key, constants, id(owner), f"{type(owner).__name__} step")
    return result


def _forget(owner: int) -> None:
    _state["owners"].discard(owner)
    mod = native.module()
    if mod is not None:
        mod.forget(owner)


def _watched(run: Callable) -> tuple:
    """``run()``'s result and its :class:`Watch` (every torch op and launch of it, in order). Calls inside it
    take the Python path, so their launches are seen."""
    from anymla.triton_kernels import launcher
    watch = Watch()
    launcher.RECORDER[0] = watch.events
    _state["watching"], _state["watch"] = True, watch
    try:
        with watch:
            result = run()
    finally:
        launcher.RECORDER[0] = None
        _state["watching"], _state["watch"] = False, None
    return result, watch


def _make(mod, decision, op: int, args: tuple, result, watch: Watch, refusal_key, constants=(), owner: int = 0,
          what: str = ""):
    what = what or decision.shape
    try:
        _register(mod, decision, op, args, result, watch, constants, owner)
    except Refused as why:
        _state["refused"][refusal_key] = (decision, f"{what}: {why}")
    except Exception as e:  # noqa: BLE001  (the call's result stands; its signature keeps the Python path)
        _state["refused"][refusal_key] = (decision, f"{what}: describing the call failed: {e!r}")


def _register(mod, decision, op: int, args: tuple, result: tuple, watch: Watch, constants=(), owner: int = 0) -> None:
    """Make the watched call an entry: its allocations, ATen ops and launches in the order they ran."""
    if watch.refused:
        raise Refused(watch.refused)
    places = Places({i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}, constants)
    steps, desc_inputs, device, kernels = [], set(), None, []
    allocated = 0
    for event in watch.events:
        if event[0] == "alloc":
            t = event[1]
            steps.append(("alloc", tuple(t.shape), tuple(t.stride()), t.dtype, allocated in watch.poisoned))
            allocated += 1
            places.values.append(t)
            device = device or t.device
        elif event[0] == "op":
            _, func, op_args, kwargs, out = event
            steps.append(op_spec(func, op_args, kwargs, places))
            places.values.append(out)
            device = device or out.device
        elif event[0] == "call":
            _, fn, call_args, out = event
            steps.append(call_spec(fn, call_args, out, places))
            places.values.extend(out)
            device = device or out[0].device
        else:
            direct, grid, flat = event
            if direct is None:
                raise Refused("a launch went through no compiled kernel's launcher")
            spec, desc_input = launch_spec(direct, grid, flat, places)
            steps.append(("launch", spec))
            kernels.append(direct)
            desc_inputs.add(desc_input)
    desc_inputs.discard(None)
    if len(desc_inputs) > 1:
        raise Refused("tensor descriptors over two inputs")
    if device is None:
        raise Refused("the call makes no tensor")
    desc_input = desc_inputs.pop() if desc_inputs else -1
    variant = args[desc_input].data_ptr() if desc_input >= 0 else 0
    outputs = [places.ref(t) for t in result]
    try:
        mod.register(op, args, _device_spec(device), list(places.constants), steps, outputs, desc_input, variant,
                     decision.sched_config if decision is not None else None, (decision, kernels), None, owner)
    except (TypeError, ValueError) as e:
        raise Refused(f"the extension took no entry: {e}") from None


def prepare(device, timeout: float = 300.0) -> str:
    """Build the extension for calls on ``device`` and wait for it, at most ``timeout`` seconds (benchmarks and
    :func:`anymla.warmup` measure and warm the path users get); what it says: built, or why calls keep the
    Python path."""
    if getattr(device, "type", device) == "cuda":
        native.build(wait=True, timeout=timeout)
    why = native.reason()
    return "compiled call path: " + (f"not in use ({why})" if why else "in use")


def _device_spec(device) -> tuple[str, int]:
    """``(type, index)`` of an entry's device (its current device where a CUDA device has no index)."""
    if device.type == "cuda" and device.index is None:
        return "cuda", torch.cuda.current_device()
    return device.type, -1 if device.index is None else device.index


def refusals() -> list[str]:
    """Why calls of each refused signature keep the Python path: ``"<what was called>: <reason>"``."""
    return [why for _, why in _state["refused"].values()]


def clear() -> None:
    """Forget every entry and refusal (the dispatcher's decision cache was cleared)."""
    mod = native.module()
    if mod is not None:
        mod.clear()
    _state["refused"].clear()
