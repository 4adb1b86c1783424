"""Benchmark of token-balanced update dispatch (protocol ``mesh_balanced``, the actor's and critic's update default;
verl's ``trainer.balance_batch``) against ``mesh``'s contiguous split, on rollouts whose response lengths vary.

Two gloo ranks, one thread each, the ``fsdp`` actor at ~20M parameters (``bench/e2e_fixture.py``'s ``20m``) in bf16
(what ``mixed_precision: auto`` resolves to at that size on this CPU), the trainer's default forward (the lean
forward without padding, each prompt computed once). Each step's batch is a GRPO rollout of the e2e fixture's shape
(16 prompts × 4 samples) whose response lengths vary: each prompt draws a typical length from a long-tailed
distribution (``--min-response`` … ``--max-response``, log-uniform) and its samples vary around it by ±25%, as a
hard prompt's samples all run long. ``--batches`` such rollouts (seeded, the same on both ranks); each is trained
once split as ``mesh`` splits it (rank r the r-th half of the rows, in the rollout's order) and once as
``mesh_balanced`` splits it (:func:`hybridflow.transfer.builtin_protocols.balanced_order`, then halves), the two
alternating which goes first. A step's time is rank 0's wall time of ``train_step`` (the ranks meet in its
collectives, so it is the slower rank's); tokens per rank are counted from the halves' attention masks. The loss is
the contract suites' sequence NLL: the forward and backward, not the loss, set the cost.

Prints ``RESULT {json}``: per variant the median step time and the mean over batches of the busiest rank's tokens
over the mean rank's (1.0 = even); ``speedup`` = the contiguous split's total time over the batches ÷ the balanced
split's, and the median over batches of the per-batch ratio (the batches differ more in cost than the variants do,
so the ratio of the two medians would mostly compare different batches).

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=core:plugins/fsdp python bench/balance.py`` (about two minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import results_page

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPTS, SAMPLES = 16, 4
VARIANTS = ("mesh", "mesh_balanced")


def rollout(seed: int, min_response: int, max_response: int) -> Any:
    """One GRPO-shaped rollout (left-padded prompts of 5-7 tokens, right-padded responses) with a ``uid`` per
    prompt group."""
    import math

    import torch

    from hybridflow.batch import Batch
    from hybridflow_fsdp.models import compute_position_ids

    generator = torch.Generator().manual_seed(seed)
    prompt_width = 7
    typical = [math.exp(math.log(min_response) + float(torch.rand(1, generator=generator))
                        * (math.log(max_response) - math.log(min_response))) for _ in range(PROMPTS)]
    lengths = [max(1, min(max_response, round(typical[row // SAMPLES] * (0.75 + 0.5 * float(
        torch.rand(1, generator=generator)))))) for row in range(PROMPTS * SAMPLES)]
    rows, width = PROMPTS * SAMPLES, max(lengths)
    prompts = torch.zeros(PROMPTS, prompt_width, dtype=torch.long)
    prompt_mask = torch.zeros(PROMPTS, prompt_width, dtype=torch.long)
    for group in range(PROMPTS):
        used = int(torch.randint(5, 8, (1,), generator=generator))
        prompts[group, prompt_width - used:] = torch.randint(3, 40, (used,), generator=generator)
        prompt_mask[group, prompt_width - used:] = 1
    responses = torch.randint(3, 40, (rows, width), generator=generator)
    response_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    responses = responses * response_mask
    attention_mask = torch.cat([prompt_mask.repeat_interleave(SAMPLES, 0), response_mask], 1)
    return Batch({"input_ids": torch.cat([prompts.repeat_interleave(SAMPLES, 0), responses], 1),
                  "attention_mask": attention_mask, "responses": responses, "response_mask": response_mask,
                  "position_ids": compute_position_ids(attention_mask)},
                 {"uid": [f"p{row // SAMPLES}" for row in range(rows)]})


def _rank(rank: int, world_size: int, args: dict[str, Any], out: str) -> None:
    import torch

    from e2e_fixture import model_config_of
    from hybridflow.controller.host import tune_malloc
    from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngineConfig
    from hybridflow.testing.contracts.training import sequence_mean_nll
    from hybridflow.transfer.builtin_protocols import balanced_order
    from hybridflow_fsdp.training import FSDPTrainingEngine

    torch.set_num_threads(1)
    tune_malloc()  # as every worker does at start-up
    actor = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
        model=ModelSpec(config=model_config_of(args["size"]), seed=0), optim=OptimConfig(lr=1e-4),
        micro_batch_size=PROMPTS * SAMPLES, mixed_precision="bf16"))
    warm = rollout(10_000, args["min_response"], args["max_response"])
    for _ in range(2):
        actor.train_step(warm.chunk(world_size)[rank], loss_fn=sequence_mean_nll)
    rows: list[dict[str, Any]] = []
    for index in range(args["batches"]):
        batch = rollout(index, args["min_response"], args["max_response"])
        order = balanced_order(batch, world_size)
        splits = {"mesh": batch, "mesh_balanced": batch if order is None else batch.index(order)}
        for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
            halves = splits[variant].chunk(world_size)
            started = time.perf_counter()
            actor.train_step(halves[rank], loss_fn=sequence_mean_nll)
            rows.append({"batch": index, "variant": variant, "seconds": time.perf_counter() - started,
                         "tokens": [int(half["attention_mask"].sum()) for half in halves]})
    Path(f"{out}.{rank}").write_text(json.dumps(rows))


def main() -> None:
    from hybridflow.testing.contracts.spawn import run_rank_groups

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="20m", help="bench/e2e_fixture.py model size (77k, 2.4m, 20m)")
    parser.add_argument("--batches", type=int, default=16, help="rollouts, each trained once per variant")
    parser.add_argument("--min-response", type=int, default=16, help="shortest typical response of a prompt")
    parser.add_argument("--max-response", type=int, default=256, help="longest response")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="balance_"))
    load = os.getloadavg()[0]
    run_rank_groups([(_rank, 2, (vars(args), str(workdir / "rank")))], workdir=workdir, timeout_s=1800)
    rows = json.loads((workdir / "rank.0").read_text())
    result: dict[str, Any] = {"size": args.size, "ranks": 2, "prompts": PROMPTS, "samples": SAMPLES,
                              "batches": args.batches, "response_range": [args.min_response, args.max_response],
                              "load_avg_1m": [load, os.getloadavg()[0]]}
    for variant in VARIANTS:
        mine = [row for row in rows if row["variant"] == variant]
        result[variant] = {
            "step_ms_median": round(1e3 * statistics.median(row["seconds"] for row in mine), 1),
            "busiest_over_mean_tokens": round(statistics.mean(
                max(row["tokens"]) / statistics.mean(row["tokens"]) for row in mine), 3)}
    seconds = {(row["batch"], row["variant"]): row["seconds"] for row in rows}
    batches = range(args.batches)
    result["speedup"] = round(sum(seconds[b, "mesh"] for b in batches)
                              / sum(seconds[b, "mesh_balanced"] for b in batches), 3)
    result["speedup_per_batch_median"] = round(statistics.median(
        seconds[b, "mesh"] / seconds[b, "mesh_balanced"] for b in batches), 3)
    results_page.result(result)


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="Token-balanced update dispatch vs the split in order"))
