"""Reading checkpoint files as data, never as code.

Every pickle-bearing file of a checkpoint is read through this module (or
:mod:`hybridflow.checkpoint_files.safe_dcp`, the torch distributed checkpoint reader built on it), by every engine,
on resume and on ``hybridflow export``:

- files written with ``torch.save`` go through :func:`load_torch_file`: ``torch.load(weights_only=True)`` (torch's
  own allow-list: tensors, storages, plain containers and scalars) plus the few classes a caller names (DeepSpeed's
  optimizer-state classes, say);
- other pickles (torch DCP's ``.metadata``) go through :class:`RestrictedUnpickler`: only the globals of an explicit
  allow-list are resolved, only their instances are built, and a class object is never modified.

A refused file raises :class:`hybridflow.errors.UnsafeCheckpointError` naming the file and the global found in it;
a file that is merely unreadable (cut short, not a pickle) raises :class:`hybridflow.errors.CheckpointError` with the
unpickler's cause. Nothing of a refused file runs: a global outside the list is never imported.
"""

from __future__ import annotations

import enum
import io
import pickle
import pickletools
import re
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, ClassVar

import torch

from hybridflow.errors import CheckpointError, UnsafeCheckpointError

__all__ = ["load_torch_file", "load_torch_stream", "RestrictedUnpickler", "restricted_pickle_load", "refusal",
           "referenced_globals", "enum_member_by_name", "global_name"]

#: how this module's own refusals start, so that :func:`refusal` finds what was refused inside torch's message
_REFUSED = "hybridflow refused:"
_TORCH_REFUSED = (re.compile(r"Unsupported global: GLOBAL (\S+)"), re.compile(r"unsupported GLOBAL (\S+) whose module"),
                  re.compile(re.escape(_REFUSED) + r" ([^\n]+)"))
#: opcodes whose argument is a string a later STACK_GLOBAL may take as a module or attribute name
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
                         "STRING", "SHORT_BINBYTES", "BINBYTES"})
_MEMO_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def global_name(obj: Any) -> str:
    """``module.qualname`` of a class or function: the name a pickle refers to it by."""
    return f"{obj.__module__}.{obj.__qualname__}"


def enum_member_by_name(cls: Any, name: Any) -> enum.Enum:
    """Allow-list entry ``(enum_member_by_name, "builtins.getattr")`` for files pickled by Python 3.11.0-3.11.4, which
    pickle an Enum member by name (``getattr(ZeroStageEnum, "weights")``; other Pythons by value): only a member of an
    Enum class that is itself allowed in, never any other attribute of anything."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)) or name not in cls.__members__:
        raise pickle.UnpicklingError(f"{_REFUSED} getattr({cls!r}, {name!r}), which is not a member of an Enum class")
    return cls[name]


def load_torch_file(path: str | Path, *, allowed: Sequence[Any] = (), map_location: Any = "cpu",
                    mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` with ``allowed`` (classes and functions, or ``(object, "module.name")``
    pairs, as ``torch.serialization.safe_globals`` takes them) added to torch's allow-list for this call only.

    Raises:
        UnsafeCheckpointError: the file holds a global outside the list (named in the error); nothing of it ran.
        CheckpointError: the file is missing or unreadable (the unpickler's cause is in the message).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint {path.parent} is incomplete. Fix: "
                              "resume or export from another checkpoint")
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:  # any failure to unpickle: refused or unreadable, said which below
        with path.open("rb") as handle:
            raise refusal(path, exc, handle, allowed=allowed) from exc


def load_torch_stream(stream: IO[bytes], *, path: str | Path, allowed: Sequence[Any] = (),
                      map_location: Any = "cpu") -> Any:
    """:func:`load_torch_file` for bytes of a file already open (a slice of a torch DCP ``.distcp`` file, say);
    ``path`` names the file in errors."""
    start = stream.tell()
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(stream, map_location=map_location, weights_only=True)
    except Exception as exc:  # any failure to unpickle: refused or unreadable, said which below
        stream.seek(start)
        raise refusal(Path(path), exc, stream, allowed=allowed) from exc


def refusal(path: str | Path, exc: BaseException, data: IO[bytes] | None, *,
            allowed: Sequence[Any] = ()) -> CheckpointError:
    """The error for a checkpoint file whose unpickling failed with ``exc``: :class:`UnsafeCheckpointError` when it
    holds a global outside torch's ``weights_only`` list and ``allowed`` (named from the message, else found by
    scanning ``data``'s pickle opcodes without running them), else a :class:`CheckpointError` with the cause."""
    message = str(exc)
    for pattern in _TORCH_REFUSED:
        match = pattern.search(message)
        if match:
            return UnsafeCheckpointError(str(path), match.group(1).rstrip("."))
    if isinstance(exc, pickle.UnpicklingError) and data is not None:  # e.g. a protocol-4 STACK_GLOBAL torch rejects
        known = _torch_allowed_names(allowed)               # as an "unsupported operand": name the global itself
        forbidden = [name for name in referenced_globals(data) if name not in known]
        if forbidden:
            return UnsafeCheckpointError(str(path), ", ".join(forbidden))
    cause = message.partition("WeightsUnpickler error:")[2].strip() or message  # torch's general advice cut off
    return CheckpointError(f"checkpoint file {path} could not be read ({type(exc).__name__}: {cause[:300]}); it is "
                           "damaged (an interrupted copy, a full disk) or does not belong to this checkpoint. Fix: "
                           "resume or export from another checkpoint")


def _torch_allowed_names(allowed: Sequence[Any]) -> set[str]:
    """Names ``torch.load(weights_only=True)`` resolves by default, plus ``allowed``'s (only to word an error)."""
    names = {entry[1] if isinstance(entry, tuple) else global_name(entry) for entry in allowed}
    try:
        from torch import _weights_only_unpickler as unpickler

        names |= set(unpickler._get_allowed_globals())
        names |= set(unpickler._get_user_allowed_globals())  # type: ignore[no-untyped-call]  # untyped in torch
    except (ImportError, AttributeError):  # private in torch: without it every global is listed, still named
        pass
    return names


def _pickles(data: IO[bytes]) -> Iterator[IO[bytes]]:
    """The pickle streams of a file: ``data.pkl`` of a torch zip file, else the file itself (a plain pickle, or
    torch's legacy format: several pickles in a row, then raw storage bytes)."""
    start = data.tell()
    if zipfile.is_zipfile(data):
        data.seek(start)
        with zipfile.ZipFile(data) as archive:
            for member in archive.namelist():
                if member.endswith(".pkl"):
                    with archive.open(member) as stream:
                        yield io.BytesIO(stream.read())
        return
    data.seek(start)
    yield data


def referenced_globals(data: IO[bytes]) -> list[str]:
    """Every global (``module.name``) the pickles in ``data`` refer to, in order, read from their opcodes without
    unpickling anything. A STACK_GLOBAL's names are the two strings pushed (or fetched from the memo) before it."""
    found: list[str] = []
    for stream in _pickles(data):
        while True:
            memo: dict[int, str | None] = {}
            pushed: list[str | None] = []  # the value each opcode pushed (a string, else None): STACK_GLOBAL's operands
            position = stream.tell()
            try:
                for opcode, arg, _ in pickletools.genops(stream):
                    name = opcode.name
                    if name in ("GLOBAL", "INST"):
                        module, _, attribute = str(arg).partition(" ")
                        found.append(f"{module}.{attribute}")
                    elif name == "STACK_GLOBAL":
                        names = pushed[-2:]
                        found.append(".".join(str(part) for part in names) if len(names) == 2 and None not in names
                                     else "a global named at unpickling time")
                    if name in _STRING_OPS:
                        pushed.append(arg.decode("latin-1") if isinstance(arg, bytes) else str(arg))
                    elif name in _MEMO_GETS:
                        pushed.append(memo.get(int(str(arg))))
                    elif name == "MEMOIZE":
                        memo[len(memo)] = pushed[-1] if pushed else None
                    elif name in _MEMO_PUTS:
                        memo[int(str(arg))] = pushed[-1] if pushed else None
                    elif opcode.stack_after:
                        pushed.append(None)
            except Exception:  # noqa: BLE001 - the end of the pickles (raw storage bytes follow) or a damaged one
                break
            if stream.tell() == position:
                break
    return list(dict.fromkeys(found))


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickles only what ``allowed`` (``"module.name"`` → object) lists: another global raises before it is
    imported; REDUCE and NEWOBJ call only listed callables and classes; BUILD sets state only on instances of listed
    classes (never on a class object, which would change it for the whole process).

    The pure-Python unpickler, so that each of those opcodes can be checked; meant for small files (metadata)."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # the pure-Python unpickler's stack (not in typeshed)

    def __init__(self, file: IO[bytes], *, allowed: Mapping[str, Any]) -> None:
        super().__init__(file)
        self._allowed = dict(allowed)
        self._callables = {id(value) for value in allowed.values() if callable(value)}
        self._classes = {value for value in allowed.values() if isinstance(value, type)}

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key not in self._allowed:
            raise pickle.UnpicklingError(f"{_REFUSED} {key}")
        return self._allowed[key]

    def _refuse_unless(self, ok: bool, what: Any, action: str) -> None:
        if not ok:
            raise pickle.UnpicklingError(f"{_REFUSED} {action} {what!r}, which the allow-list does not name")

    def _load_reduce(self) -> None:
        func = self.stack[-2]
        self._refuse_unless(id(func) in self._callables, func, "a call of")
        pickle._Unpickler.load_reduce(self)  # type: ignore[attr-defined]  # undocumented in typeshed

    def _load_newobj(self) -> None:
        cls = self.stack[-2]
        self._refuse_unless(cls in self._classes, cls, "a new object of")
        pickle._Unpickler.load_newobj(self)  # type: ignore[attr-defined]  # undocumented in typeshed

    def _load_newobj_ex(self) -> None:
        cls = self.stack[-3]
        self._refuse_unless(cls in self._classes, cls, "a new object of")
        pickle._Unpickler.load_newobj_ex(self)  # type: ignore[attr-defined]  # undocumented in typeshed

    def _load_build(self) -> None:
        instance = self.stack[-2]
        self._refuse_unless(type(instance) in self._classes, type(instance), "setting the state of")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]  # undocumented in typeshed

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ
        self._refuse_unless(klass in self._classes, klass, "a new object of")
        pickle._Unpickler._instantiate(self, klass, args)  # type: ignore[attr-defined]  # undocumented in typeshed



RestrictedUnpickler.dispatch.update({pickle.REDUCE[0]: RestrictedUnpickler._load_reduce,
                                     pickle.NEWOBJ[0]: RestrictedUnpickler._load_newobj,
                                     pickle.NEWOBJ_EX[0]: RestrictedUnpickler._load_newobj_ex,
                                     pickle.BUILD[0]: RestrictedUnpickler._load_build})


def restricted_pickle_load(path: str | Path, *, allowed: Mapping[str, Any]) -> Any:
    """Unpickle ``path`` with :class:`RestrictedUnpickler` over ``allowed``.

    Raises:
        UnsafeCheckpointError: the file holds a global outside the list, or would call, build or set the state of
            something the list does not name (named in the error); nothing of it ran.
        CheckpointError: the file is missing or not a complete pickle.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint {path.parent} is incomplete. Fix: "
                              "resume or export from another checkpoint")
    with path.open("rb") as handle:
        try:
            return RestrictedUnpickler(handle, allowed=allowed).load()
        except Exception as exc:  # refused (our message) or unreadable, said which by refusal()
            raise refusal(path, exc, None) from exc
