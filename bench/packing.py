"""Benchmark of padding removal: the fsdp training engine's train step and log-prob pass on a length-skewed batch,
padded against packed (``use_remove_padding``), and packed with token-budget micro-batches, side by side in one run.

One process, one thread, an unsharded fp32 engine (the single-rank engine; the two-rank default runs the same HF
forward through FSDP2, plus collectives that packing does not change). The batch: ``--rows`` rollout-shaped rows,
left-padded prompts and right-padded responses, total lengths spread evenly over ``--min-length`` …
``4 × --min-length`` (a 4× span; ``--spread long_tail``: most rows short, a few long). Variants, measured
interleaved (ABCD BCDA …) so machine load hits all alike:
``padded`` (HF forward on padded rows, ``use_remove_padding=false, extra.lean_forward=false``), ``padded_lean``
(the lean forward on padded rows, ``use_remove_padding=false``), ``packed`` (the default: the lean forward with the
padding removed from its linear layers), ``packed_hf`` (HF's modules over the packed sequence, per-row attention:
what a model the lean forward does not run gets, and the default before 2026-12-03) and ``packed_budget`` (packed,
``max_tokens_per_micro_batch`` = ``--budget``). The engine's default takes the lean forward for micro-batches that
repeat prompts (``--samples`` > 1) and HF's packed forward for the others, so ``packed`` is ``packed_hf`` at
``--samples 1``. Prints one ``RESULT {json}``
line per variant (median ms of a train step and of a log-prob pass) and a summary with packed's speedups.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=core:plugins/fsdp python bench/packing.py`` (about two minutes on one core;
``--hidden 64 --layers 2`` for the 77K-parameter fixture).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "core"), str(ROOT / "plugins" / "fsdp")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import results_page  # noqa: E402
from hybridflow.batch import Batch  # noqa: E402
from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngineConfig  # noqa: E402
from hybridflow.presets import tiny_model_config  # noqa: E402
from hybridflow_fsdp.training import LOSS_SCALE_TOKENS, FSDPTrainingEngine  # noqa: E402


def skewed_batch(rows: int, min_length: int, seed: int = 0, *, spread: str = "even", samples: int = 1) -> Batch:
    """Rows whose total lengths run from ``min_length`` to ``4 × min_length`` (``even``ly, or ``long_tail``: the
    cube of an even spread, most rows short and a few long, as RL responses that mostly stop early); a quarter of
    each is prompt. ``samples`` > 1: consecutive groups of that many rows share the first one's prompt (a rollout's
    n samples of one prompt), their responses keeping their own lengths."""
    generator = torch.Generator().manual_seed(seed)
    power = 3 if spread == "long_tail" else 1
    totals = [min_length + round(3 * min_length * (row / max(rows - 1, 1)) ** power) for row in range(rows)]
    prompts = [max(1, total // 4) for total in totals]
    responses = [total - prompt for total, prompt in zip(totals, prompts, strict=True)]
    width_p, width_r = max(prompts), max(responses)
    prompt_ids = torch.randint(4, 45, (rows, width_p), generator=generator)
    response_ids = torch.randint(4, 45, (rows, width_r), generator=generator)
    prompt_mask = torch.zeros(rows, width_p, dtype=torch.long)
    response_mask = torch.zeros(rows, width_r, dtype=torch.long)
    order = torch.randperm(rows, generator=generator).tolist()  # lengths shuffled over rows, as rollouts come
    for row, source in enumerate(order):
        prompt_mask[row, width_p - prompts[source]:] = 1
        response_mask[row, : responses[source]] = 1
    if samples > 1:
        for row in range(rows):
            prompt_ids[row], prompt_mask[row] = prompt_ids[row - row % samples], prompt_mask[row - row % samples]
    prompt_ids, response_ids = prompt_ids * prompt_mask, response_ids * response_mask
    return Batch({"input_ids": torch.cat([prompt_ids, response_ids], 1),
                  "attention_mask": torch.cat([prompt_mask, response_mask], 1), "responses": response_ids,
                  "response_mask": response_mask, "advantages": torch.randn(rows, width_r, generator=generator)},
                 meta={"policy_version": 0, "iteration": 0})


def policy_gradient_loss(outputs: Any, micro_batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean ``-A · log π`` over the mini-batch (the engine's loss-scale convention)."""
    mask = micro_batch["response_mask"].float()
    weighted = outputs["log_probs"] * micro_batch["advantages"] * mask
    return -weighted.sum() / micro_batch.meta[LOSS_SCALE_TOKENS], {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--min-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--budget", type=int, default=0, help="token budget of packed_budget (0: 8 mean rows)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spread", choices=("even", "long_tail"), default="even")
    parser.add_argument("--samples", type=int, default=1,
                        help="rows per prompt (4: a rollout's layout, where the lean forward computes each once)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    heads = max(2, args.hidden // 32)
    model = tiny_model_config(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_layers=args.layers,
                              num_heads=heads, num_kv_heads=max(1, heads // 2), max_position_embeddings=1024)
    batch = skewed_batch(args.rows, args.min_length, spread=args.spread, samples=args.samples)
    lengths = batch["attention_mask"].sum(1)
    budget = args.budget or int(lengths.float().mean() * args.micro_batch_size)
    base = TrainingEngineConfig(model=ModelSpec(config=model, seed=0), optim=OptimConfig(lr=1e-4),
                                micro_batch_size=args.micro_batch_size)
    variants: dict[str, dict[str, Any]] = {
        "padded": {"use_remove_padding": False, "extra": {"lean_forward": False}},
        "padded_lean": {"use_remove_padding": False},
        "packed": {"use_remove_padding": True},
        "packed_hf": {"use_remove_padding": True, "extra": {"lean_forward": False}},
        "packed_budget": {"use_remove_padding": True, "max_tokens_per_micro_batch": max(budget, int(lengths.max()))},
    }
    engines = {name: FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(**{
        **{field: getattr(base, field) for field in ("model", "optim", "micro_batch_size")}, **options}))
        for name, options in variants.items()}
    parameters = sum(p.numel() for p in engines["packed"].model.parameters())
    times: dict[str, dict[str, list[float]]] = {name: {"train": [], "log_probs": []} for name in engines}
    names = list(engines)
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:  # rotated: no variant always last
            engine = engines[name]
            start = time.perf_counter()
            engine.train_step(batch, loss_fn=policy_gradient_loss)
            train = time.perf_counter() - start
            start = time.perf_counter()
            engine.compute_log_probs(batch)
            log_probs = time.perf_counter() - start
            if repeat:
                times[name]["train"].append(train * 1000)
                times[name]["log_probs"].append(log_probs * 1000)
    medians = {name: {kind: statistics.median(values) for kind, values in kinds.items()}
               for name, kinds in times.items()}
    shape = {"parameters": parameters, "spread": args.spread, "samples": args.samples, "rows": args.rows,
             "min_length": int(lengths.min()),
             "max_length": int(lengths.max()), "padded_width": int(batch["input_ids"].shape[1]),
             "valid_fraction": round(float(lengths.sum()) / batch["attention_mask"].numel(), 3)}
    for name, result in medians.items():
        results_page.result({"variant": name, **variants[name], **shape,
                                      "train_step_ms": round(result["train"], 1),
                                      "log_probs_ms": round(result["log_probs"], 1)})
    packed = medians["packed"]
    results_page.result({"summary": "packed speedup", **shape, **{
        f"{kind}_vs_{name}": round(medians[name][kind] / packed[kind], 2)
        for name in ("padded", "padded_lean", "packed_hf") for kind in ("train", "log_probs")},
        "packed_budget_train_vs_packed": round(medians["packed_budget"]["train"] / packed["train"], 2)})


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="Padding removal: train step and log-prob pass, padded vs packed"))
