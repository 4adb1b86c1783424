"""``Batch``: the one type exchanged between dataflow nodes — tensor columns, non-tensor columns and ``meta``.

Tensor columns live in a :class:`tensordict.TensorDict` with one batch dimension; non-tensor columns are numpy
object arrays of the same length; ``meta`` carries the ``policy_version`` and ``iteration`` that every transfer
checks. Pickling (and so Ray) is zero-copy: tensors travel as numpy views in pickle-5 out-of-band buffers. How a
batch is split across ranks is the transfer protocols' business, not this module's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDict

from hybridflow.errors import VersionMismatchError

__all__ = ["Batch", "PADDING_KEY", "VERSION_KEYS", "check_versions"]

#: meta keys that must agree whenever batches are combined or fed to one method
VERSION_KEYS = ("policy_version", "iteration")
#: bool column marking rows added by padded chunking
PADDING_KEY = "is_padding"


def check_versions(metas: Iterable[Mapping[str, Any]], *, what: str = "batches") -> dict[str, Any]:
    """Return the agreed version keys of ``metas``; raise :class:`VersionMismatchError` if any two disagree."""
    agreed: dict[str, Any] = {}
    for meta in metas:
        for key in VERSION_KEYS:
            if key not in meta or meta[key] is None:
                continue
            if key in agreed and agreed[key] != meta[key]:
                raise VersionMismatchError(
                    f"{what} disagree on {key}: {agreed[key]} vs {meta[key]}. Every input of one step must come "
                    f"from the same rollout; the iteration is aborted so weight versions are never mixed."
                )
            agreed[key] = meta[key]
    return agreed


def _as_object_array(values: Any, length: int, key: str) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == object:
        array = values
    else:
        array = np.empty(len(values), dtype=object)
        array[:] = list(values)
    if len(array) != length:
        raise ValueError(f'non-tensor column "{key}" has {len(array)} rows, expected {length} (the batch size)')
    return array


def _tensor_to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy(), "bfloat16"
    return tensor.numpy(), ""


def _numpy_to_tensor(array: np.ndarray, special: str) -> torch.Tensor:
    if array.flags.writeable:
        tensor = torch.from_numpy(array)
    else:
        # Arrays read zero-copy from Ray's object store are read-only. We keep them zero-copy: columns of a
        # received batch are treated as immutable (engines write new columns, never in place).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if special == "bfloat16" else tensor


def _rebuild(tensors: dict[str, tuple[np.ndarray, str]], non_tensors: dict[str, np.ndarray], meta: dict[str, Any],
             length: int) -> Batch:
    return Batch(
        tensors={key: _numpy_to_tensor(array, special) for key, (array, special) in tensors.items()},
        non_tensors=non_tensors,
        meta=meta,
        batch_size=length,
    )


class Batch:
    """Columns of equal length plus ``meta``. Stability: public."""

    __slots__ = ("tensors", "non_tensors", "meta")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | TensorDict | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        *,
        batch_size: int | None = None,
    ) -> None:
        if isinstance(tensors, TensorDict):
            self.tensors = tensors
        else:
            tensors = dict(tensors or {})
            if batch_size is None:
                lengths = {len(t) for t in tensors.values()} | {len(v) for v in (non_tensors or {}).values()}
                if len(lengths) > 1:
                    raise ValueError(f"columns have different lengths {sorted(lengths)}; all must share the batch dim")
                batch_size = lengths.pop() if lengths else 0
            self.tensors = TensorDict(tensors, batch_size=[batch_size])
        length = int(self.tensors.batch_size[0]) if self.tensors.batch_dims else 0
        self.non_tensors = {k: _as_object_array(v, length, k) for k, v in (non_tensors or {}).items()}
        self.meta: dict[str, Any] = dict(meta or {})

    # --- inspection -----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.tensors.batch_size[0]) if self.tensors.batch_dims else 0

    @property
    def policy_version(self) -> int | None:
        return self.meta.get("policy_version")

    @property
    def iteration(self) -> int | None:
        return self.meta.get("iteration")

    def keys(self) -> list[str]:
        # the TensorDict is flat: str keys (tensordict's types allow nested tuple keys, which a Batch never has)
        return cast(list[str], list(self.tensors.keys())) + list(self.non_tensors)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (key in self.tensors.keys() or key in self.non_tensors)

    def __getitem__(self, key: str) -> Any:
        if key in self.non_tensors:
            return self.non_tensors[key]
        if key in self.tensors.keys():
            return self.tensors[key]
        raise KeyError(f'Batch has no column "{key}". Columns: {", ".join(self.keys()) or "(none)"}.')

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if len(value) != len(self):
                raise ValueError(f'column "{key}" has {len(value)} rows, expected {len(self)}')
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            self.tensors.pop(key, None) if key in self.tensors.keys() else None
            self.non_tensors[key] = _as_object_array(value, len(self), key)

    def nbytes(self) -> int:
        """Bytes held by tensor columns (what a transfer moves; object columns are not counted)."""
        return int(sum(t.numel() * t.element_size() for t in cast(Iterable[torch.Tensor], self.tensors.values())))

    def __repr__(self) -> str:
        cols = [f"{k}:{tuple(v.shape)}:{str(v.dtype).removeprefix('torch.')}" for k, v in self.tensors.items()]
        cols += [f"{k}:object" for k in self.non_tensors]
        return f"Batch(len={len(self)}, columns=[{', '.join(cols)}], meta={self.meta})"

    # --- building -------------------------------------------------------------------------------------------
    def _with(
        self, tensors: TensorDict, non_tensors: dict[str, np.ndarray], meta: dict[str, Any] | None = None
    ) -> Batch:
        return Batch(tensors, non_tensors, dict(self.meta) if meta is None else meta)

    def select(self, *keys: str) -> Batch:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no column(s) {missing}. Columns: {', '.join(self.keys())}.")
        tensor_keys = [k for k in keys if k in self.tensors.keys()]
        non_tensors = {k: self.non_tensors[k] for k in keys if k in self.non_tensors}
        return self._with(self.tensors.select(*tensor_keys), non_tensors)

    def slice(self, start: int, stop: int) -> Batch:
        return self._with(self.tensors[start:stop], {k: v[start:stop] for k, v in self.non_tensors.items()})

    def index(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.long)
        np_idx = idx.numpy()
        return self._with(self.tensors[idx], {k: v[np_idx] for k, v in self.non_tensors.items()})

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        if sum(sizes) != len(self):
            raise ValueError(f"split sizes {list(sizes)} sum to {sum(sizes)}, expected the batch size {len(self)}")
        out, start = [], 0
        for size in sizes:
            out.append(self.slice(start, start + size))
            start += size
        return out

    def chunk(self, chunks: int, *, pad: bool = False) -> list[Batch]:
        """Split into ``chunks`` equal parts; uneven sizes raise unless ``pad=True`` (see :meth:`pad_to_multiple`)."""
        if chunks <= 0:
            raise ValueError(f"chunks must be positive, got {chunks}")
        batch = self
        if len(self) % chunks:
            if not pad:
                raise ValueError(
                    f"cannot split a batch of {len(self)} rows evenly into {chunks} chunks; make the batch size a "
                    f"multiple of {chunks} or use a padded split (protocol dp_compute_padded)"
                )
            batch = self.pad_to_multiple(chunks)
        size = len(batch) // chunks
        return [batch.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def pad_to_multiple(self, multiple: int) -> Batch:
        """Append copies of the last rows until the length divides ``multiple``; mark them in ``is_padding``."""
        if len(self) == 0:
            raise ValueError("cannot pad an empty batch")
        missing = (-len(self)) % multiple
        padded = self if missing == 0 else Batch.concat([self, self.index([len(self) - 1] * missing)])
        return padded.mark_padding(missing)

    def mark_padding(self, rows: int) -> Batch:
        """A new batch (same tensors) whose ``is_padding`` column marks the last ``rows`` rows."""
        mask = torch.zeros(len(self), dtype=torch.bool)
        if rows:
            mask[len(self) - rows:] = True
        marked = self._with(self.tensors.clone(recurse=False), dict(self.non_tensors))
        marked.tensors[PADDING_KEY] = mask
        return marked

    def drop_padding(self) -> Batch:
        """Remove rows marked in ``is_padding`` (and the column itself)."""
        if PADDING_KEY not in self.tensors.keys():
            return self
        keep = (~self.tensors[PADDING_KEY]).nonzero().flatten()
        out = self.index(keep)
        del out.tensors[PADDING_KEY]
        return out

    def repeat_interleave(self, repeats: int) -> Batch:
        """Each row ``repeats`` times in a row (n samples per prompt: rows i·n … i·n+n−1 share prompt i)."""
        idx = torch.arange(len(self)).repeat_interleave(repeats)
        return self.index(idx)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all ``batches`` in order; meta must agree on version keys (other meta from the first)."""
        if not batches:
            raise ValueError("cannot concatenate zero batches")
        agreed = check_versions((b.meta for b in batches), what="concatenated batches")
        keys = [set(b.keys()) for b in batches]
        if any(k != keys[0] for k in keys):
            raise ValueError(f"cannot concatenate batches with different columns: {[sorted(k) for k in keys]}")
        if len(batches) == 1:
            return batches[0]
        tensors = cast(TensorDict, torch.cat([b.tensors for b in batches], dim=0))  # TensorDict's torch.cat
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in batches[0].non_tensors}
        meta = dict(batches[0].meta)
        meta.update(agreed)
        return Batch(tensors, non_tensors, meta)

    def union(self, other: Batch) -> Batch:
        """Columns of both (same rows); ``other`` wins on shared columns; version keys must agree."""
        if len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        agreed = check_versions([self.meta, other.meta], what="unioned batches")
        tensors = self.tensors.clone(recurse=False)
        tensors.update(other.tensors)
        non_tensors = {**self.non_tensors, **other.non_tensors}
        for key in other.tensors.keys():
            non_tensors.pop(cast(str, key), None)
        for key in other.non_tensors:
            if key in tensors.keys():
                del tensors[key]
        meta = {**self.meta, **other.meta, **agreed}
        return Batch(tensors, non_tensors, meta)

    __or__ = union

    def with_meta(self, **meta: Any) -> Batch:
        return self._with(self.tensors, dict(self.non_tensors), {**self.meta, **meta})

    def to(self, device: str | torch.device) -> Batch:
        return self._with(self.tensors.to(device), dict(self.non_tensors))

    # --- serialization --------------------------------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        tensors = {key: _tensor_to_numpy(cast(torch.Tensor, value)) for key, value in self.tensors.items()}
        return (_rebuild, (tensors, self.non_tensors, self.meta, len(self)))

    def equals(self, other: Batch) -> bool:
        """Same columns, same values bit for bit, same meta (test helper)."""
        if set(self.keys()) != set(other.keys()) or len(self) != len(other) or self.meta != other.meta:
            return False
        if any(not torch.equal(self.tensors[k], other.tensors[k]) for k in self.tensors.keys()):
            return False
        return all(list(self.non_tensors[k]) == list(other.non_tensors[k]) for k in self.non_tensors)
