"""Lets megatron-core 0.16 run on a CPU-only torch: CUDA calls inside megatron modules are mapped to the CPU.

Scope and limits (see docs/guide/megatron.md): it is activated only for ``device="cpu"`` and never on a GPU run; it
rebinds the name ``torch`` inside already-imported ``megatron.core`` modules to a proxy (so no other library sees a
change), installs a CPU RNG tracker, and patches ``Tensor.cuda``/``Tensor.type`` only inside
:func:`cpu_tensor_methods` blocks around model and optimizer construction. It leaves fusions, TransformerEngine,
CUDA graphs, async checkpointing, overlapped communication and mixed-precision grad scaling to GPU runs: callers
must switch those off (:mod:`hybridflow_megatron.model` does).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hybridflow.errors import EngineError

__all__ = ["activate_cpu_shim", "deactivate_cpu_shim", "is_cpu_shim_active", "cpu_tensor_methods"]

#: torch factory functions whose ``device=`` megatron writes as a "cuda" literal
_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "empty_like",
    "zeros_like", "ones_like", "full_like", "as_tensor",
)
_active = False


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int):
        return "cpu"
    return device


def _wrap_factory(function: Callable[..., Any]) -> Callable[..., Any]:
    def factory(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return function(*args, **kwargs)

    factory.__name__ = getattr(function, "__name__", "factory")
    return factory


class _NoStream:
    """Stands in for a CUDA stream or event: every method is a no-op and it is its own context manager."""

    def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    def __enter__(self) -> _NoStream:
        return self

    def __exit__(self, *exc: object) -> None: ...

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen from megatron modules: device calls answer with the CPU, syncs are no-ops."""

    def __init__(self) -> None:
        super().__init__("torch.cuda (hybridflow CPU shim)")
        self.current_device = lambda: torch.device("cpu")
        self.synchronize = lambda *args, **kwargs: None
        self.empty_cache = lambda: None
        self.set_device = lambda *args: None
        self.device_count = lambda: 1
        self.manual_seed = torch.manual_seed
        self.manual_seed_all = torch.manual_seed
        self.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        self.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
        self.Stream = _NoStream
        self.Event = _NoStream
        self.stream = lambda *args, **kwargs: _NoStream()
        self.current_stream = lambda *args, **kwargs: _NoStream()
        self.default_stream = lambda *args, **kwargs: _NoStream()
        self.nvtx = _NoStream()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` as seen from megatron modules: real torch except ``cuda`` and device-literal factories."""

    def __init__(self) -> None:
        super().__init__("torch (hybridflow CPU shim)")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _wrap_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    base = megatron_random.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]  # megatron-core is untyped: base is Any
        """Megatron's RNG tracker over the CPU default generator (forked states, same names and seeds)."""

        def add(self, name: str, seed: int) -> None:
            if name in self.states_:
                raise EngineError(f"RNG state {name!r} already added; expected each name once")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise EngineError(f"RNG state {name!r} was never added; known: {sorted(self.states_)}")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    if not getattr(megatron_random._CUDA_RNG_STATE_TRACKER, "_hybridflow_cpu", False):
        tracker = CpuRNGStatesTracker()
        tracker._hybridflow_cpu = True
        megatron_random._CUDA_RNG_STATE_TRACKER = tracker
        megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


_PROXY: _CpuTorch | None = None


def _patch_loaded_megatron_modules() -> int:
    global _PROXY
    if _PROXY is None:
        _PROXY = _CpuTorch()
    patched = 0
    for name, module in list(sys.modules.items()):
        if ((name == "megatron.core" or name.startswith("megatron.core.")) and module is not None
                and getattr(module, "torch", None) is torch):
            vars(module)["torch"] = _PROXY
            patched += 1
    return patched


def activate_cpu_shim(device: str) -> bool:
    """Make the loaded megatron-core modules run on the CPU; a no-op (returns False) unless ``device == "cpu"``.

    Safe to call repeatedly: each call also covers megatron modules imported since the last one. Raises
    :class:`EngineError` if asked on a process whose torch already runs megatron on CUDA.
    """
    global _active
    if device != "cpu":
        return False
    # import the modules the engine uses before patching
    import megatron.core.distributed
    import megatron.core.models.gpt.gpt_model
    import megatron.core.optimizer
    import megatron.core.pipeline_parallel.schedules
    import megatron.core.tensor_parallel  # noqa: F401

    _patch_loaded_megatron_modules()
    _install_rng_tracker()
    _active = True
    return True


def deactivate_cpu_shim() -> int:
    """Undo :func:`activate_cpu_shim`: megatron's modules see the real ``torch`` again (as in a fresh process, whose
    next CPU engine activates the shim anew); returns how many modules were restored. Call it with no megatron model
    left in use (hybridflow_megatron.model.release_megatron_state)."""
    global _active
    restored = 0
    if _PROXY is not None:
        for name, module in list(sys.modules.items()):
            if ((name == "megatron.core" or name.startswith("megatron.core.")) and module is not None
                    and vars(module).get("torch") is _PROXY):
                vars(module)["torch"] = torch
                restored += 1
    _active = False
    return restored


def is_cpu_shim_active() -> bool:
    """Whether :func:`activate_cpu_shim` ran in this process."""
    return _active


@contextlib.contextmanager
def cpu_tensor_methods() -> Iterator[None]:
    """Within the block, ``Tensor.cuda()`` returns the tensor and ``Tensor.type()`` names CPU float types as CUDA.

    Megatron's distributed optimizer and grad clipping check ``param.type() == "torch.cuda.FloatTensor"`` and
    GPTModel moves tied embeddings with ``.cuda()``; only model/optimizer construction and ``optimizer.step()``
    run inside this block.
    """
    if not _active:
        yield
        return
    original_cuda, original_type = torch.Tensor.cuda, torch.Tensor.type

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    def tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original_type(self, *args, **kwargs)
        if not args and not kwargs and self.device.type == "cpu" and name.startswith("torch."):
            return "torch.cuda." + name[len("torch."):]
        return name

    # replacing these torch methods is the point of the shim; their stub signatures are narrower than ours
    torch.Tensor.cuda = cuda  # type: ignore[method-assign, assignment]
    torch.Tensor.type = tensor_type  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.Tensor.cuda = original_cuda  # type: ignore[method-assign]  # restoring what the shim replaced
        torch.Tensor.type = original_type  # type: ignore[method-assign]  # restoring what the shim replaced
