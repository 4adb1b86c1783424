"""A DeepSpeed checkpoint file that cannot be read as data says why: the global torch's ``weights_only`` refused
(an ``UnsafeCheckpointError``), or the unpickler's own cause (a damaged file), not only torch's general advice. A
file written by Python 3.11.0-3.11.4 (Debian 12's 3.11.2), which pickle an Enum member by name through ``getattr``,
loads; ``getattr`` reaches nothing else."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.errors import CheckpointError, UnsafeCheckpointError
from hybridflow_deepspeed.safe_files import load_deepspeed_file

pytestmark = [pytest.mark.deepspeed,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not installed (bash scripts/setup.sh --all)")]


@dataclass
class Unlisted:
    """A class no ``weights_only`` allow-list names (as an unknown DeepSpeed or library class would be)."""

    value: int = 1


def test_a_refused_global_is_named(tmp_path: Path) -> None:
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Unlisted()}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"outside the allow-list: \S*Unlisted \(") as caught:
        load_deepspeed_file(path)
    assert caught.value.path == str(path)


def test_a_damaged_file_gives_the_unpicklers_cause(tmp_path: Path) -> None:
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"weights": torch.zeros(64)}, path)
    path.write_bytes(path.read_bytes()[:200])  # cut short, as a write interrupted midway leaves it
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {path} could not be read")) as caught:
        load_deepspeed_file(path)
    assert not isinstance(caught.value, UnsafeCheckpointError)  # damaged, not refused
    assert "In PyTorch 2.6" not in str(caught.value), caught.value  # the cause, not torch's general advice


@dataclass
class ByName:
    """Pickles as Python 3.11.0-3.11.4 pickle an Enum member (``getattr(cls, name)``), whatever this Python does."""

    owner: Any
    name: str

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return getattr, (self.owner, self.name)


def test_an_enum_member_pickled_by_name_loads(tmp_path: Path) -> None:
    from deepspeed.runtime.zero.config import ZeroStageEnum

    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"zero_stage": ByName(ZeroStageEnum, "weights"), "weights": torch.ones(3)}, path)
    state = load_deepspeed_file(path)
    assert state["zero_stage"] is ZeroStageEnum.weights and torch.equal(state["weights"], torch.ones(3))


@pytest.mark.parametrize("owner_name", [("tensor", "__init__"), ("enum", "__class__")])
def test_getattr_reaches_nothing_but_enum_members(tmp_path: Path, owner_name: tuple[str, str]) -> None:
    from deepspeed.runtime.zero.config import ZeroStageEnum

    owner = {"tensor": torch.Tensor, "enum": ZeroStageEnum}[owner_name[0]]
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"x": ByName(owner, owner_name[1])}, path)
    with pytest.raises(UnsafeCheckpointError, match="which is not a member of an Enum class"):
        load_deepspeed_file(path)
