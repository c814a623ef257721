"""The compiled call path: a repeated call of a signature the Triton tier has planned, run in C++.

The public functions try :func:`entry_point` first; it returns the call's outputs when an entry of the
call's key exists, and None otherwise, and then the Python path runs (validate, select, plan, launch). On
that path, :func:`record` watches a call the Triton tier runs and turns it into an entry
(``record.py`` says when it refuses, ``callpath.cpp`` how an entry runs). An entry is the decision's plan in
compiled form, made from what that plan did: no choice is made twice.

Entries are kept per selection scope (the ``backend=`` keyword, :func:`anymla.use_backend` or
``ANYMLA_BACKEND``, scoped settings such as ``tuning.forced``), as decisions are. The entry point is not used
with debug checks on (they read the data every call) or while a Triton launch hook is installed (profilers
read launches there); a change of the tuning file or of the backend registry forgets every entry.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..debug import debug_enabled
from ..registry import generation
from ..selection import _SETTINGS, _override, _sync_tuning
from . import native
from .record import Refused, Watch, launch_spec, output_specs, Places

DECODE, PREFILL = 0, 1
_state: dict = {"stamp": None, "refused": {}, "test_device": False, "hooks": None}
_native_state = native._state
_scopes: dict = {}  # (forced backends, their source, scoped settings) -> its number in entries' keys


def _launch_hooks() -> tuple:
    """``(Triton's runtime knobs, which hold its two launch-hook slots, and the test for an installed hook)``,
    or () for a Triton without them (< 3.4)."""
    from anymla.triton_kernels.launcher import _installed, _knobs
    knobs = _knobs()
    return () if knobs is None else ((knobs, _installed), )


def entry_point(backend) -> Optional[tuple[Callable, int]]:
    """``(call, scope)``: the compiled entry point ``call(op, poison, sched, scope, *args)`` and the number of
    the call's selection scope (its ``backend`` keyword, :func:`anymla.use_backend` context or
    ``ANYMLA_BACKEND``, and scoped settings: a decision is made for one scope, so an entry is kept for one);
    None while calls must take the Python path (see the module's docstring)."""
    mod = _native_state["module"]
    if mod is None or debug_enabled():
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
    scope = (*_override(backend), _SETTINGS.get())
    number = _scopes.get(scope)
    if number is None:
        number = _scopes[scope] = len(_scopes)
    return mod.call, number


def _eligible(decision) -> bool:
    """Whether the decision's calls can have entries: on a CUDA device (or, in tests, any device while a
    stand-in for the driver is configured), the Triton tier's or those of a backend that has its own form."""
    return decision.device.startswith("cuda") or _state["test_device"]


def record(entry: Optional[tuple], decision, op: int, problem, args: tuple, run: Callable):
    """``run()`` (the Python path of ``problem``'s call, after its decision), watched and made an entry where
    it can be; ``entry`` is what :func:`entry_point` returned for this call and ``args`` the call's key
    arguments after its scope. Other backends than the Triton tier give their own form of the calls
    (``Backend.entry``) or none."""
    if not _eligible(decision):
        return run()
    mod = native.module()
    if entry is None:
        if mod is None and decision.backend == "triton":
            native.build()  # in the background: this and later calls take the Python path meanwhile
        return run()
    args = (entry[1], *args)
    if id(decision) in _state["refused"] or mod.has(op, args):
        return run()
    if decision.backend != "triton":
        own = decision.impl.entry(problem, decision.plan)
        if own is not None:
            mod.register(op, args, _device_spec(problem.device), (), (), -1, (0, ()), decision.sched_config,
                         decision, own)
        return run()
    if decision.plan is None:
        return run()
    from anymla.triton_kernels import launcher
    launches: list = []
    watch = Watch()
    launcher.RECORDER[0] = launches
    try:
        with watch:
            result = run()
    finally:
        launcher.RECORDER[0] = None
    try:
        _register(mod, decision, op, args, result, launches, watch)
    except Refused as why:
        _state["refused"][id(decision)] = (decision, str(why))
    except Exception as e:  # noqa: BLE001  (the call's result stands; its signature keeps the Python path)
        _state["refused"][id(decision)] = (decision, f"describing the call failed: {e!r}")
    return result


def _register(mod, decision, op: int, args: tuple, result: tuple, launches: list, watch: Watch) -> None:
    if watch.refused:
        raise Refused(watch.refused)
    if any(direct is None for direct, _, _ in launches):
        # a first launch at a new alignment still goes through Triton's own path when a hook takes it
        raise Refused("a launch went through no compiled kernel's launcher")
    inputs = {i: a for i, a in enumerate(args) if hasattr(a, "data_ptr")}
    places = Places(inputs, watch.allocations)
    specs, desc_inputs = [], set()
    for direct, grid, flat in launches:
        spec, desc_input = launch_spec(direct, grid, flat, places)
        specs.append(spec)
        desc_inputs.add(desc_input)
    desc_inputs.discard(None)
    if len(desc_inputs) > 1:
        raise Refused("tensor descriptors over two inputs")
    desc_input = desc_inputs.pop() if desc_inputs else -1
    variant = args[desc_input].data_ptr() if desc_input >= 0 else 0
    if not watch.allocations:
        raise Refused("the call allocates nothing")
    allocations = [(tuple(a.shape), tuple(a.stride()), a.dtype) for a in watch.allocations]
    try:
        mod.register(op, args, _device_spec(watch.allocations[0].device), allocations,
                     output_specs(result, watch.allocations), desc_input, (variant, specs), decision.sched_config,
                     decision)
    except (TypeError, ValueError) as e:
        raise Refused(f"the extension took no entry: {e}") from None


def prepare(device) -> str:
    """Build the extension for calls on ``device`` and wait for it (benchmarks and :func:`anymla.warmup`
    measure and warm the path users get); what it says: built, or why calls keep the Python path."""
    if getattr(device, "type", device) == "cuda":
        native.build(wait=True)
    why = native.reason()
    return "compiled call path: " + (f"not in use ({why})" if why else "in use")


def _device_spec(device) -> tuple[str, int]:
    """``(type, index)`` of an entry's device (its current device where a CUDA device has no index)."""
    import torch
    if device.type == "cuda" and device.index is None:
        return "cuda", torch.cuda.current_device()
    return device.type, -1 if device.index is None else device.index


def refusals() -> list[str]:
    """Why calls of each refused signature keep the Python path: ``"<decision's shape>: <reason>"``."""
    return [f"{d.shape}: {why}" for d, why in _state["refused"].values()]


def clear() -> None:
    """Forget every entry and refusal (the dispatcher's decision cache was cleared)."""
    mod = native.module()
    if mod is not None:
        mod.clear()
    _state["refused"].clear()
