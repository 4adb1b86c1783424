"""Dynamic sampling (``algorithm.filter_groups``): which groups are kept, how many generation batches are drawn, the
top-up once the bound is reached, and the config checks."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.dynamic_sampling import fill_informative_groups, group_is_informative
from hybridflow.batch import Batch
from hybridflow.config import Config


def scored(scores: list[float], tag: str, n: int = 2, width: int = 3) -> Batch:
    """A scored rollout of len(scores) / n groups: uids ``{tag}{group}``, responses carrying the row's score."""
    rows = len(scores)
    return Batch({"scores": torch.tensor(scores),
                  "responses": torch.tensor(scores).repeat_interleave(width).view(rows, width)},
                 {"uid": [f"{tag}{row // n}" for row in range(rows)]}, meta={"iteration": 0, "policy_version": 0})


def test_groups_whose_samples_disagree_are_informative() -> None:
    assert group_is_informative(torch.tensor([0.0, 1.0, 1.0, 1.0, 0.5, 0.5000001]), 2) == [True, False, False]
    with pytest.raises(ValueError, match=r"groups of rollout\.n = 4"):
        group_is_informative(torch.zeros(6), 4)


def test_keeps_informative_groups_and_draws_until_the_batch_is_full() -> None:
    more = iter([scored([1, 1, 0, 1, 0, 0], "b"), scored([0, 1, 1, 0, 1, 1], "c")])
    calls: list[int] = []

    def generate_more() -> Batch:
        calls.append(1)
        return next(more)

    first = scored([0, 0, 1, 0, 1, 1], "a")  # only group a1 disagrees
    batch, metrics = fill_informative_groups(first, n=2, groups_wanted=3, metric="score", max_num_gen_batches=0,
                                             generate_more=generate_more)
    assert list(batch["uid"]) == ["a1", "a1", "b1", "b1", "c0", "c0"]  # generation order; c1 not needed
    assert len(calls) == 2
    assert metrics == {"train/num_gen_batches": 3.0, "train/informative_group_ratio": 4 / 9,
                       "train/filter_groups_exhausted": 0.0}
    assert torch.equal(batch["responses"][:, 0], batch["scores"])  # rows stay whole


def test_the_bound_tops_the_batch_up_with_uninformative_groups() -> None:
    drawn: list[Batch] = []

    def generate_more() -> Batch:
        drawn.append(scored([1, 1, 1, 1, 0, 0], f"m{len(drawn)}"))
        return drawn[-1]

    first = scored([0, 1, 0, 0, 0, 0], "a")
    batch, metrics = fill_informative_groups(first, n=2, groups_wanted=3, metric="score", max_num_gen_batches=2,
                                             generate_more=generate_more)
    assert len(drawn) == 1  # the bound counts the first batch
    assert list(batch["uid"]) == ["a0", "a0", "a1", "a1", "a2", "a2"]  # informative first, then spares in order
    assert metrics["train/filter_groups_exhausted"] == 1.0 and metrics["train/num_gen_batches"] == 2.0


def test_metric_names_a_per_row_column_and_a_missing_one_is_explained() -> None:
    first = scored([0, 0, 1, 1], "a")
    first["acc"] = torch.tensor([0.0, 1.0, 1.0, 1.0])
    batch, _ = fill_informative_groups(first, n=2, groups_wanted=1, metric="acc", max_num_gen_batches=1,
                                       generate_more=lambda: pytest.fail("no draw needed"))
    assert list(batch["uid"]) == ["a0", "a0"]
    with pytest.raises(ValueError, match="no column 'seq_final_reward'"):
        fill_informative_groups(first, n=2, groups_wanted=1, metric="seq_final_reward", max_num_gen_batches=1,
                                generate_more=lambda: first)


def _config(**algorithm: object) -> Config:
    return Config.model_validate({
        "algorithm": {"name": "grpo", "filter_groups": {"enable": True}, **algorithm},
        "resource_pools": {"main": {"devices_per_node": [1]}, "gen": {"devices_per_node": [1]}},
        "actor": {"pool": "main"}, "rollout": {"n": 4}})


def test_config_checks() -> None:
    assert _config().algorithm.filter_groups.max_num_gen_batches == 0
    with pytest.raises(ValueError, match=r"rollout\.pool = 'gen' generates each step's rollout ahead"):
        Config.model_validate({**_config().model_dump(), "rollout": {"n": 4, "pool": "gen"}})
    with pytest.raises(ValueError, match=r"rollout\.n = 1"):
        Config.model_validate({**_config().model_dump(), "rollout": {"n": 1}})
