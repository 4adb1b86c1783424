"""Typed exceptions raised by hybridflow; every message says what was expected, what was got and how to fix it.

Plugins raise these too, so a user catches one family (:class:`HybridflowError`) whatever backend failed.
"""

from __future__ import annotations

__all__ = [
    "HybridflowError",
    "PluginLoadError",
    "PluginValidationError",
    "RegistryError",
    "DuplicateNameError",
    "UnknownNameError",
    "ConfigError",
    "SandboxUnavailableError",
    "DatasetError",
    "RewardError",
    "VersionMismatchError",
    "WorkerError",
    "DeadlineExceededError",
    "LayoutError",
    "ReshardError",
    "CheckpointError",
    "UnsafeCheckpointError",
    "PlacementError",
    "EngineError",
    "EngineContractError",
    "is_deterministic",
]


class HybridflowError(Exception):
    """Base class of every error hybridflow raises on purpose."""


class PluginLoadError(HybridflowError):
    """A plugin's entry point failed to import or register."""

    def __init__(
        self,
        *,
        plugin: str,
        distribution: str,
        version: str,
        entry_point: str,
        cause: BaseException,
        fix: str,
    ) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.version = version
        self.entry_point = entry_point
        self.cause = cause
        self.fix = fix
        super().__init__(
            f'Plugin "{plugin}" ({distribution} {version}, entry point {entry_point}) failed to import: '
            f"{type(cause).__name__}: {cause}. {fix}"
        )


class PluginValidationError(HybridflowError):
    """A plugin implements a hook that does not exist or with the wrong signature."""


class RegistryError(HybridflowError):
    """Base class of registry errors."""


class DuplicateNameError(RegistryError):
    """A name was registered twice in the same registry."""


class UnknownNameError(RegistryError, KeyError):
    """A registry lookup for a name that nobody registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class ConfigError(HybridflowError, ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


class SandboxUnavailableError(ConfigError):
    """A tool that runs model-written code cannot get its kernel-enforced sandbox here (and the config did not opt
    out); the message names what is missing and how to install it."""


class DatasetError(HybridflowError, ValueError):
    """A dataset file is missing, empty, unreadable or lacks a required column."""


class RewardError(HybridflowError):
    """A reward function raised, returned NaN or returned the wrong shape."""


class VersionMismatchError(HybridflowError):
    """Inputs of one transfer disagree on ``policy_version`` or ``iteration``."""


class WorkerError(HybridflowError):
    """A remote worker raised; carries the rank and the worker's traceback."""

    def __init__(self, message: str, *, rank: int | None = None, method: str | None = None,
                 remote_traceback: str = "", deterministic: bool = False) -> None:
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        #: the remote error was one that repeats on every retry (:func:`is_deterministic`): recovery does not retry
        self.deterministic = deterministic
        super().__init__(message)


class DeadlineExceededError(HybridflowError, TimeoutError):
    """A remote call did not finish within its deadline (the watchdog fired)."""


class LayoutError(HybridflowError, ValueError):
    """A parallel layout or shard spec is invalid (sizes do not divide, axes unknown, ...)."""


class ReshardError(HybridflowError):
    """A reshard plan could not be built or executed."""


class CheckpointError(HybridflowError):
    """A checkpoint is missing, incomplete or corrupted."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds a pickled object outside the allow-list of what hybridflow writes (a class or function
    that unpickling would import and could call): the file was refused before anything in it ran.

    ``path`` is the file, ``found`` what was refused (a global such as ``posix.system``, or the unpickler's reason).
    """

    def __init__(self, path: str, found: str) -> None:
        self.path = path
        self.found = found
        super().__init__(
            f"checkpoint file {path} holds a pickled object outside the allow-list: {found} (expected only tensors, "
            "plain values and the checkpoint classes hybridflow itself writes). It was not loaded: unpickling it "
            "could run code. Fix: if this checkpoint did not come from your own run, delete it; if hybridflow wrote "
            "it, re-save it with this version (resume from an earlier checkpoint), or report the class named above"
        )

    def __reduce__(self) -> tuple[type[UnsafeCheckpointError], tuple[str, str]]:  # pickles (Ray, torch collectives)
        return type(self), (self.path, self.found)


class PlacementError(HybridflowError):
    """No placement satisfies the memory floors or the device count."""


class EngineError(HybridflowError):
    """A training or rollout engine was misconfigured or misused."""


class EngineContractError(EngineError):
    """An engine plugin breaks its declared contract (a capability it declared and does not implement, a shard it
    cannot take): deterministic, so recovery never retries it."""


def is_deterministic(exc: BaseException) -> bool:
    """Whether ``exc`` would be raised again by the same call on a fresh worker: a configuration error, a plugin
    that breaks its declared contract, a plugin that fails validation. Recovery stops on these instead of
    restarting worker groups to meet them again."""
    return isinstance(exc, (ConfigError, EngineContractError, PluginValidationError))
