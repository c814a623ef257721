"""Backend registry: each backend states which ops, devices and shapes it serves, and why not otherwise.

A backend never raises to say "I can't": :meth:`Backend.not_supported_reasons` returns sentences
(xformers style), which the dispatcher shows when nothing can run and :func:`anymla.explain` shows always.
"""

from __future__ import annotations

from typing import ClassVar

import torch

OPS = ("sparse_prefill", "sparse_decode", "dense_decode")


class Backend:
    """Base class of a backend. Subclasses set the class attributes and implement one method per op.

    Methods named after an op (``sparse_prefill``, ``sparse_decode``, ``dense_decode``) take the validated
    problem record from :mod:`anymla.problems` and return the op's outputs:
    ``(out, max_logits, lse)``, ``(out, lse [b, s_q, h_q])`` and ``(out, lse [b, h_q, s_q])`` respectively.
    """

    name: ClassVar[str]
    ops: ClassVar[frozenset]
    device_types: ClassVar[tuple]
    #: external peers (FlashMLA, torch_npu) run only when asked for by name, measured faster by ``--tune``, or
    #: where :meth:`measured_faster` says anymla's own measurements found them faster
    auto_select: ClassVar[bool] = True
    #: runs wherever torch does (``device_types`` then only names the usual ones)
    any_device: ClassVar[bool] = False

    def unavailable_reasons(self, device: torch.device) -> list[str]:
        """Why this backend cannot run on ``device`` at all (package, build, hardware); empty if it can."""
        return self._device_type_reasons(device)

    def _device_type_reasons(self, device: torch.device) -> list[str]:
        if self.any_device or device.type in self.device_types:
            return []
        return [f"runs on {', '.join(self.device_types)} devices, not on {device.type}"]

    def shape_reasons(self, problem) -> list[str]:
        """Why this backend cannot run this problem's shapes, dtypes or flags; empty if it can."""
        return []

    def caveats(self, device: torch.device) -> list[str]:
        """What a user should know before trusting this backend's results or speed on ``device``: how far it
        has been verified there. Empty when nothing needs saying."""
        return []

    def measured_faster(self, problem) -> str:
        """An external peer only: why it is the faster choice for ``problem``'s regime on this device kind,
        from measurements shipped with anymla (ratios, device, date), or "" where none found it faster. The
        dispatcher then tries it before the device's priority list (it still has to support the call)."""
        return ""

    def plan(self, problem):
        """What running ``problem`` needs that depends only on its signature (which kernel and why, tiles,
        splits, grid, compiled-kernel handles), or None when there is nothing to plan. Made once per call
        signature and kept in the dispatcher's decision; its ``description`` attribute (if any) is the
        kernel line of ``explain()``. A plan holds no tensor of any call."""
        return None

    def not_supported_reasons(self, problem) -> list[str]:
        """Why this backend cannot run ``problem``; a backend for other device types says only that (what
        else it lacks is for ``unavailable_reasons``, which ``python -m anymla.bench --list`` prints)."""
        if problem.op not in self.ops:
            return [f"does not implement {problem.op} (implements: {', '.join(sorted(self.ops))})"]
        return (self._device_type_reasons(problem.device) or self.unavailable_reasons(problem.device)
                or self.shape_reasons(problem))

    def run(self, problem, plan=None):
        """The op's outputs for ``problem``; ``plan`` is what :meth:`plan` made for its signature."""
        return getattr(self, problem.op)(problem)

    def entry(self, problem, plan):
        """For the compiled call path (:mod:`anymla.callpath`): a function running every call of
        ``problem``'s signature as the public function would (taking the scheduling metadata, or None, then
        the public function's arguments in order, and returning its outputs), without the problem record and
        the dispatcher; None where calls keep that path. The Triton tier's calls get entries of their own."""
        return None


_REGISTRY: dict[str, Backend] = {}
# Bumped on every change, so cached dispatch decisions never call a backend that was replaced or removed.
_GENERATION = [0]


def generation() -> int:
    return _GENERATION[0]


def register_backend(backend: Backend) -> Backend:
    """Add ``backend`` under ``backend.name`` (replacing a previous one of that name)."""
    if not getattr(backend, "name", None) or not set(backend.ops) <= set(OPS):
        raise ValueError(f"backend: needs a name and ops among {OPS}, got {backend!r}")
    _REGISTRY[backend.name] = backend
    _GENERATION[0] += 1
    return backend


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)
    _GENERATION[0] += 1


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"backend: unknown backend {name!r} (registered: {', '.join(_REGISTRY)})") from None


def registered_backends() -> list[str]:
    return list(_REGISTRY)
