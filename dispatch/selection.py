"""Backend selection: overrides, priorities per device, measured (tuned) choices, and explanations.

Precedence: the ``backend=`` keyword, then :func:`use_backend` (a context manager, contextvar-based), then
the ``ANYMLA_BACKEND`` environment variable, then a tuned choice (``ANYMLA_TUNING`` file written by
``python -m anymla.bench --tune``), then an installed peer that anymla's shipped measurements found faster for
the call's regime on this device kind (``Backend.measured_faster``), then the automatic priority order of the
device. An explicit choice that cannot run raises :class:`BackendNotSupported` with every reason; an automatic
one falls back to the next backend. Decisions are cached per call signature (shapes, dtypes, devices, strides, flags), together
with the chosen backend's launch plan for it (its kernel, tile, splits, grid and compiled-kernel handles), so
a repeated call costs one dictionary lookup plus building the signature before its launch. A decision is
keyed also by everything else it depends on: the overrides in force, the tuning file, the registry's
generation and the backends' scoped settings (:func:`scoped_settings`, e.g. ``tuning.forced``), so changing
any of them makes the next call decide afresh. ``explain()`` returns the very object the call runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from .debug import debug_enabled
from .environment import reader
from .registry import Backend, generation, get_backend, registered_backends

PRIORITY = {
    "cuda": ("triton", "reference"),
    "npu": ("ascendc", "triton", "reference"),
    # Triton runs on the CPU only through its interpreter: correct but far slower than torch.
    "cpu": ("reference", "triton"),
}
DEFAULT_PRIORITY = ("triton", "reference")
ENV_BACKEND = "ANYMLA_BACKEND"
ENV_TUNING = "ANYMLA_TUNING"
_CACHE_LIMIT = 4096
_read_backend = reader(ENV_BACKEND)
_read_tuning = reader(ENV_TUNING)

BackendChoice = Union[str, Sequence[str], None]


class BackendNotSupported(RuntimeError):
    """An explicitly requested backend (or every backend) cannot run a call; the message lists why."""


@dataclass(frozen=True)
class Decision:
    """The dispatcher's choice for one call signature, with the reason every other backend was not chosen,
    and the chosen backend's launch plan: what ``explain()`` prints is what runs."""

    op: str
    backend: str
    source: str  # "keyword", "context", "env", "tuned", "measured" or "auto"
    device: str
    shape: str
    rejected: tuple = ()  # ((backend name, (reason, ...)), ...)
    impl: Backend = field(default=None, repr=False, compare=False)
    caveats: tuple = ()  # how far the chosen backend has been verified on this device
    kernel: str = ""  # which of the backend's kernels runs, and why (from the plan)
    plan: object = field(default=None, repr=False, compare=False)  # the backend's launch plan (None: none)
    sched_config: object = field(default=None, repr=False, compare=False)  # decode: FlashMLASchedMeta.Config
    measured: str = ""  # source "measured": the measurement that put the chosen peer first

    def run(self, problem):
        """Run ``problem`` (a record of this decision's signature) on the chosen backend."""
        return self.impl.run(problem, self.plan)

    def __str__(self) -> str:
        lines = [f"{self.op} on {self.device}: {self.backend} (chosen by {self.source})", f"  shape: {self.shape}"]
        lines += [f"  measured: {self.measured}"] if self.measured else []
        lines += [f"  kernel: {self.kernel}"] if self.kernel else []
        lines += [f"  caveat: {c}" for c in self.caveats]
        lines += [f"  not {name}: {'; '.join(reasons)}" for name, reasons in self.rejected]
        return "\n".join(lines)


_CONTEXT: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("anymla_backend", default=None)
# Backends' scoped settings (sorted (name, value) pairs): part of every decision's cache key.
_SETTINGS: contextvars.ContextVar[tuple] = contextvars.ContextVar("anymla_settings", default=())
_DECISIONS: dict = {}
_MADE = [0]  # decisions made since import (anymla.warmup reports how many it made)
# The tuned choices in force; "version" changes whenever they do (it is part of every decision's cache key),
# "env" is the value of ANYMLA_TUNING they were last synchronized with.
_TUNING: dict = {"path": None, "choices": {}, "version": 0, "env": None}
# Backend-name strings already parsed and checked against the registry (keyed with its generation).
_PARSED_NAMES: dict = {}


def _as_names(choice: BackendChoice, what: str) -> tuple:
    if isinstance(choice, str):
        names = _PARSED_NAMES.get((choice, generation()))
        if names is None:
            names = _PARSED_NAMES[(choice, generation())] = _parse_names(choice, what)
        return names
    return _parse_names(choice, what)


def _parse_names(choice: BackendChoice, what: str) -> tuple:
    names = tuple(n.strip() for n in choice.split(",")) if isinstance(choice, str) else tuple(choice)
    names = tuple(n for n in names if n)
    for n in names:
        get_backend(n)  # unknown names raise ValueError at once
    if not names:
        raise ValueError(f"{what}: expected a backend name or a list of names, got {choice!r}")
    return names


@contextlib.contextmanager
def use_backend(choice: BackendChoice):
    """Run the calls inside the block on ``choice`` (a name, ``"a,b"`` or a list tried in order).

    ``None`` restores automatic selection inside the block. The previous setting returns on exit.
    """
    token = _CONTEXT.set(None if choice is None else _as_names(choice, "use_backend"))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def scoped_settings(**values):
    """Settings a backend reads while planning (e.g. ``triton_kernels.tuning.forced``: pinned tiles, split
    counts, kernels) for the calls inside the block; ``None`` values leave a setting as it is. They key the
    decision cache, so a call inside the block never reuses a plan made outside it, and the reverse."""
    merged = dict(_SETTINGS.get())
    merged.update((k, v) for k, v in values.items() if v is not None)
    token = _SETTINGS.set(tuple(sorted(merged.items())))
    try:
        yield
    finally:
        _SETTINGS.reset(token)


def settings() -> dict:
    """The scoped settings in force (see :func:`scoped_settings`)."""
    return dict(_SETTINGS.get())


def _override(keyword: BackendChoice) -> tuple[Optional[tuple], str]:
    if keyword is not None:
        return _as_names(keyword, "backend"), "keyword"
    ctx = _CONTEXT.get()
    if ctx is not None:
        return ctx, "context"
    env = _read_backend() or ""
    if env and env != "auto":
        return _as_names(env, ENV_BACKEND), "env"
    return None, "auto"


def load_tuning(path: Optional[str]) -> None:
    """Read measured best backends per shape (``python -m anymla.bench --tune`` writes them); None clears.

    Setting, changing or unsetting ``ANYMLA_TUNING`` later loads (or clears) that file instead."""
    choices = {}
    if path:
        with open(path) as f:
            choices = json.load(f)["choices"]
    _TUNING.update(path=path, choices=choices, version=_TUNING["version"] + 1)


def _sync_tuning() -> int:
    """Follow ``ANYMLA_TUNING`` (set, changed or unset since last call); the version of the choices in force."""
    env = _read_tuning() or None
    if env != _TUNING["env"]:
        _TUNING["env"] = env
        load_tuning(env)
    return _TUNING["version"]


def _tuned(problem) -> Optional[str]:
    return _TUNING["choices"].get(tuning_key(problem))


def tuning_key(problem) -> str:
    return f"{problem.device.type}|{problem.shape_key()}"


def _priority(device: torch.device) -> tuple:
    order = PRIORITY.get(device.type, DEFAULT_PRIORITY)
    rest = [n for n in registered_backends() if n not in order]
    return tuple(n for n in order if n in registered_backends()) + tuple(rest)


def _decide(problem, forced: Optional[tuple], source: str) -> Decision:
    dev = str(problem.device)
    reasons = {}
    if forced is not None:
        for name in forced:
            reasons[name] = get_backend(name).not_supported_reasons(problem)
            if not reasons[name]:
                return _decision(problem, name, source, reasons)
        detail = "\n".join(f"  - {n}: {'; '.join(r)}" for n, r in reasons.items())
        raise BackendNotSupported(f"{problem.op}: the requested backend(s) {', '.join(forced)} (from {source}) "
                                  f"cannot run this call on {dev} ({problem.shape_key()}):\n{detail}")
    tuned = _tuned(problem)
    measured = {n: why for n in registered_backends() if (why := get_backend(n).measured_faster(problem))}
    order = ((tuned,) if tuned in registered_backends() else ()) + tuple(measured) + _priority(problem.device)
    chosen = None
    for name in order:
        b = get_backend(name)
        if name in reasons:
            continue
        r = b.not_supported_reasons(problem)
        if not r and not b.auto_select and name != tuned and name not in measured:
            r = ["an external peer: used only when asked for by name or measured faster (--tune, or anymla's "
                 "own measurements for this regime)"]
        if not r and chosen is None:
            chosen = name
        elif not r:
            r = [f"supported, but {chosen} comes first on {problem.device.type}"]
        reasons[name] = r
    if chosen is None:
        detail = "\n".join(f"  - {n}: {'; '.join(r)}" for n, r in reasons.items())
        raise BackendNotSupported(f"{problem.op}: no backend can run this call on {dev} ({problem.shape_key()}):\n{detail}")
    source = "tuned" if chosen == tuned else "measured" if chosen in measured else "auto"
    return _decision(problem, chosen, source, reasons, measured.get(chosen, "") if source == "measured" else "")


def _decision(problem, chosen: str, source: str, reasons: dict, measured: str = "") -> Decision:
    rejected = tuple((n, tuple(r)) for n, r in reasons.items() if n != chosen)
    impl = get_backend(chosen)
    plan = impl.plan(problem)
    return Decision(problem.op, chosen, source, str(problem.device), problem.shape_key(), rejected, impl,
                    tuple(impl.caveats(problem.device)), getattr(plan, "description", ""), plan,
                    problem.sched_config() if hasattr(problem, "sched_config") else None, measured)


def select(problem, backend: BackendChoice = None) -> Decision:
    """The decision for ``problem``: validated and planned on first sight of its signature, then cached.

    Every call also checks the values its signature leaves out (``problem.check_values``) and, in debug mode
    (:mod:`anymla.debug`), the tensors' contents (``problem.check_data``)."""
    forced, source = _override(backend)
    key = (problem.signature(), forced, source, _sync_tuning(), generation(), _SETTINGS.get())
    decision = _DECISIONS.get(key)
    if decision is None:
        problem.validate()
    problem.check_values()
    if debug_enabled():
        problem.check_data()
    if decision is None:
        decision = _decide(problem, forced, source)
        _MADE[0] += 1
        if len(_DECISIONS) >= _CACHE_LIMIT:
            _DECISIONS.clear()
        _DECISIONS[key] = decision
    return decision


def decisions_made() -> int:
    """How many decisions (validated, planned call signatures) the dispatcher has made since import."""
    return _MADE[0]


def clear_decision_cache() -> None:
    """Forget every decision, and the compiled call path's entries made from them."""
    from . import callpath
    _DECISIONS.clear()
    callpath.clear()


def available_backends(device: Union[str, torch.device, None] = None) -> list[str]:
    """Backends that can run on ``device`` (default: the best device here: cuda, then npu, then cpu)."""
    device = default_device() if device is None else torch.device(device)
    return [n for n in registered_backends() if not get_backend(n).unavailable_reasons(device)]


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return torch.device("npu")
    return torch.device("cpu")
