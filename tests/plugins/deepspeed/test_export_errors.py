"""A DeepSpeed checkpoint file the exporter cannot read says why: the global torch's ``weights_only`` refused, or the
unpickler's own cause (a damaged file), not only torch's general advice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hybridflow.errors import CheckpointError

export = pytest.importorskip("hybridflow_deepspeed.export")


@dataclass
class Unlisted:
    """A class no ``weights_only`` allow-list names (as an unknown DeepSpeed or library class would be)."""

    value: int = 1


def test_a_refused_global_is_named(tmp_path: Path) -> None:
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Unlisted()}, path)
    with pytest.raises(CheckpointError, match=r"holds \S*Unlisted, not allowed in"):
        export._load(path)


def test_a_damaged_file_gives_the_unpicklers_cause(tmp_path: Path) -> None:
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"weights": torch.zeros(64)}, path)
    path.write_bytes(path.read_bytes()[:200])  # cut short, as a write interrupted midway leaves it
    with pytest.raises(CheckpointError, match="could not be loaded as a DeepSpeed checkpoint file") as caught:
        export._load(path)
    assert "In PyTorch 2.6" not in str(caught.value), caught.value  # the cause, not torch's general advice
