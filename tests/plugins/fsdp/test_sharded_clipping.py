"""Gradient clipping on FSDP2's local shards (``optim.clip_sharded_grad_norm_``, what the sharded fsdp engine
clips with) against torch's ``clip_grad_norm_`` on the same DTensor gradients, on two gloo ranks: the same global
norm and the same clipped shards, whether the norm is above ``max_norm`` (scaled) or below (untouched), with a
row-parallel (``Shard(1)``) parameter among them; a replicated gradient is refused (None, nothing touched)."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.testing.contracts.spawn import run_rank_groups


class _Two(torch.nn.Module):
    """Two linears, the second sharded along dim 1 (as the row-parallel placement does), dim 0s odd: FSDP pads."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(7, 5)
        self.second = torch.nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        return self.second(torch.cat([hidden, hidden[:, :1]], dim=1))


def _rank(rank: int, world_size: int, out_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hybridflow_fsdp.optim import clip_sharded_grad_norm_

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    results: dict[str, object] = {}
    for max_norm in (0.5, 1e6):
        grads = {}
        for how in ("torch", "local"):
            torch.manual_seed(0)
            model = _Two()
            second = model.second.weight
            fully_shard(model, mesh=mesh,
                        shard_placement_fn=lambda p, second=second: Shard(1) if p is second else None)
            torch.manual_seed(1 + rank)
            model(torch.randn(4, 7)).square().sum().backward()
            if how == "torch":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
                value = float(norm.full_tensor())  # type: ignore[attr-defined]
            else:
                value = clip_sharded_grad_norm_(model.parameters(), max_norm)
            grads[how] = (value, [p.grad.full_tensor() for p in model.parameters()])  # type: ignore[union-attr]
        results[str(max_norm)] = grads
    replicated = torch.nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Replicate()]))
    replicated.grad = distribute_tensor(torch.full((3,), 2.0), mesh, [Replicate()])
    results["replicated"] = (clip_sharded_grad_norm_([replicated], 0.1), replicated.grad.full_tensor())
    if rank == 0:
        torch.save(results, out_file)


def test_local_clipping_equals_torch_on_fsdp_shards(tmp_path: Path) -> None:
    out_file = str(tmp_path / "clip.pt")
    run_rank_groups([(_rank, 2, (out_file,))], workdir=tmp_path, timeout_s=120)
    results = torch.load(out_file, weights_only=False)
    clipped_norm, unclipped_norm = results["0.5"]["torch"][0], results["1000000.0"]["torch"][0]
    assert clipped_norm > 0.5 * 4, "the gradients must be well above max_norm for the scaled case to mean anything"
    for key in ("0.5", "1000000.0"):
        (torch_norm, torch_grads), (local_norm, local_grads) = results[key]["torch"], results[key]["local"]
        assert abs(local_norm - torch_norm) <= 1e-5 * torch_norm, (key, local_norm, torch_norm)
        for ours, theirs in zip(local_grads, torch_grads, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    after = results["0.5"]["local"][1]
    total = torch.cat([g.flatten() for g in after]).norm().item()
    assert abs(total - 0.5) < 1e-4, total  # clipped to max_norm over both ranks' shards, not each rank's
    assert unclipped_norm == clipped_norm  # the norm before clipping, either way
    value, grad = results["replicated"]
    assert value is None and torch.equal(grad, torch.full((3,), 2.0)), (value, grad)
