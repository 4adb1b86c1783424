"""What the GRPO step's compute allows on this box: two ranks against one, and the default against TRL, with no
communication, no Ray and no driver — the ceiling the trainer's two ranks are measured against.

The compute of one GRPO step of ``bench/e2e_grpo.py``'s fixture (16 prompts x 4 samples, 6-token prompts, 16 new
tokens) with the kernels the trainer's ranks run, at the precision ``mixed_precision: auto`` picks for the size
(bf16 from 1M parameters on a CPU with native bf16, else fp32):
- generation: the rollout engine's lean decoder (built from the weights, as each handover does; the prompt prefilled
  once per prompt, 16 tokens decoded);
- the update: the lean forward with padding removal and each prompt computed once (``response_logits``,
  ``valid_only``), log-softmax, backward, and AdamW (foreach) on the fp32 master weights, cast back into the
  compute weights (what FSDP's next all-gather casts).
``one``: one process of 1 thread does all 64 rows and the whole optimizer (``hybridflow_1rank``'s work); ``two``: two
processes of 1 thread each, started together at a barrier every repeat, each doing 32 rows and half of every
parameter's optimizer state (the default two FSDP ranks' work, minus their collectives, handover and driver). Both
measured in the same run, alternated over ``--rounds``; per repeat the ``two`` time is the wall time from the first
start to the last end (``time.monotonic``, one clock for both processes).

``ceiling_two_over_one`` = one ÷ two: what a second rank can buy at most on these two cores (they share L3 and DRAM:
a process's matmuls slow down when the other core runs the same chain). The trainer's own ratio sits below it: a
two-rank step adds collectives and the handover, and its driver shares the two cores with the ranks, while one
rank leaves the driver a core of its own. ``ideal_tokens_per_s``: the fixture's prompt+response tokens per step ÷
the ``two`` time, the default's throughput with every collective, Ray call and driver step free.

With ``--e2e`` (default on; needs TRL from ``scripts/install_trl_bench.sh`` for the TRL rows) the same run measures
through ``bench/e2e_grpo.py``'s subprocesses the trainer's default (two FSDP ranks), ``hybridflow_1rank`` and TRL's
fp32 and bf16 rows at 2 threads (TRL's best at every size in every table so far), and prints the ratios against the
ceiling: ``ideal_over_trl_best`` bounds what the default can reach against TRL with these kernels.
``gemm_share_of_operator_time`` (one more step per process under ``torch.profiler``, not timed): the matrix products'
share of the operator time; ``gemm_only_over_trl_best`` = ``ideal_over_trl_best`` ÷ that share, the bound if every
other operator (norms, activations, attention, casts, the optimizer, sampling) were fused away to nothing.

Run: ``.venv/bin/python bench/two_core_ceiling.py [--sizes 77k,2.4m,20m] [--rounds 3] [--no-e2e]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_page
from e2e_fixture import NEW_TOKENS, PROMPTS, SAMPLES, SIZES, model_config_of

PROMPT_LENGTH = 6  # "12+57=": the fixture's prompts are 4-6 characters, most of them 6
#: the matrix-product operators whose self time is the step's GEMM share
GEMM_OPERATORS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul"})


def _precision(size: str) -> str:
    from hybridflow.engines import ModelSpec
    from hybridflow.precision import resolve_mixed_precision

    return resolve_mixed_precision("auto", engine="fsdp", device="cpu", model=ModelSpec(config=model_config_of(size)))


def _rank_work(size: str, rows: int, shard: int, shards: int, repeats: int, barrier: Any, queue: Any) -> None:
    """One process's share of a step (``rows`` rows, parameter slice ``shard`` of ``shards``), timed ``repeats``
    times after a warm-up, each repeat started at ``barrier``; puts [(start, end), ...] on ``queue``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow_fsdp.fast_decode import build_lean_decoder
    from hybridflow_fsdp.lean_forward import LeanForward

    torch.set_num_threads(1)
    values = model_config_of(size)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
    dtype = torch.bfloat16 if _precision(size) == "bf16" else torch.float32
    model = model.to(dtype)
    # the fp32 master slice this rank's optimizer owns: the shard-th of every parameter (flattened), as FSDP2 shards
    # dim 0; (parameter, its slice in the compute weights, the slice's fp32 master), parameters too small for a slice
    # of their own left to the other rank
    owned = [(p, chunks[shard], chunks[shard].float().clone()) for p in model.parameters() if p.requires_grad
             for chunks in [p.detach().view(-1).chunk(shards)] if shard < len(chunks)]
    optimizer = torch.optim.AdamW([master for _, _, master in owned], lr=1e-4, foreach=True)
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(shard)
    prompts = torch.randint(3, vocab, (rows // SAMPLES, PROMPT_LENGTH), generator=generator)
    responses = torch.randint(3, vocab, (rows, NEW_TOKENS), generator=generator)
    ids = torch.cat([prompts.repeat_interleave(SAMPLES, 0), responses], dim=1)
    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    lean = LeanForward(model)

    def step() -> None:
        with torch.no_grad():
            decoder = build_lean_decoder(model)
            assert decoder is not None
            prompt_positions = torch.arange(PROMPT_LENGTH).expand(prompts.shape[0], PROMPT_LENGTH)
            logits = decoder.prefill(prompts, torch.ones_like(prompts), prompt_positions, NEW_TOKENS, repeats=SAMPLES)
            for _ in range(NEW_TOKENS):
                logits = decoder.step(logits.argmax(-1))
            decoder.release()
        logits = lean.response_logits(ids, mask, positions, NEW_TOKENS, remove_padding=True, valid_only=True)
        picked = torch.log_softmax(logits.float(), -1).gather(-1, responses.reshape(-1, 1))
        (-picked.mean()).backward()
        for parameter, _, master in owned:
            assert parameter.grad is not None
            master.grad = parameter.grad.view(-1).chunk(shards)[shard].float()
        optimizer.step()
        with torch.no_grad():
            for _, target, master in owned:
                target.copy_(master)
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(repeats):
        barrier.wait()
        started = time.monotonic()
        step()
        times.append((started, time.monotonic()))
    # one more step under torch.profiler (not timed), every rank at once again: the matrix products' share of the
    # step's operator time (self CPU time of the GEMM operators over all operators')
    from torch.profiler import ProfilerActivity, profile

    barrier.wait()
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        step()
    events = profiled.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPERATORS)
    queue.put((times, gemm / total if total else 0.0))


def measure_compute(size: str, ranks: int, repeats: int) -> tuple[list[float], float]:
    """Seconds of each repeat of a step's compute split over ``ranks`` processes (first start to last end), and the
    GEMM operators' share of the operator time (the mean over the processes of one profiled step each)."""
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(ranks), context.Queue()
    rows = PROMPTS * SAMPLES // ranks
    processes = [context.Process(target=_rank_work, args=(size, rows, rank, ranks, repeats, barrier, queue))
                 for rank in range(ranks)]
    for process in processes:
        process.start()
    try:
        results = [queue.get(timeout=900) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    spans = [times for times, _ in results]
    return ([max(r[i][1] for r in spans) - min(r[i][0] for r in spans) for i in range(repeats)],
            statistics.mean(share for _, share in results))


def run_e2e(size: str, args: argparse.Namespace) -> tuple[dict[str, float], list[str]]:
    """The trainer's default and one rank, and TRL's 2-thread rows, through bench/e2e_grpo.py's subprocesses."""
    from e2e_grpo import run_rounds, trl_available
    from e2e_sizes import GRID_SYSTEMS, TRL_OPTIONS

    names = ["hybridflow", "hybridflow_1rank", "trl_2threads", "trl_bf16_2threads"]
    notes: list[str] = []
    why = trl_available(args)
    if why:
        names = [n for n in names if not n.startswith("trl")]
        notes.append(why)
    plans = {}
    for name in names:
        system, workers, threads = GRID_SYSTEMS[name]
        plans[name] = (system, argparse.Namespace(**{
            **vars(args), "size": size, "steps": SIZES[size]["steps"], "workers": workers or 1, "threads": threads,
            "deepspeed_zero_stage": 0, **TRL_OPTIONS.get(name, {})}))
    runs, _ = run_rounds(plans, args.e2e_repeats, SIZES[size]["warmup"], notes, label=f"{size} ")
    rates = {name: statistics.median(r["summary"]["prompt_response_tokens_per_s"] for r in system_runs)
             for name, system_runs in runs.items() if system_runs}
    return rates, notes


def main() -> None:
    from e2e_grpo import add_shared_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="77k,2.4m,20m")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of the one- and two-process runs")
    parser.add_argument("--compute-repeats", type=int, default=5,
                        help="timed steps per process per round (after one warm-up step)")
    parser.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the trainer and TRL on the same fixture in this run")
    parser.add_argument("--e2e-repeats", type=int, default=1, help="rounds of the trainer and TRL runs")
    add_shared_arguments(parser)
    args = parser.parse_args()
    tokens_per_step = PROMPTS * SAMPLES * (PROMPT_LENGTH + NEW_TOKENS)
    for size in (s.strip() for s in args.sizes.split(",") if s.strip()):
        if size not in SIZES:
            raise SystemExit(f"--sizes: unknown {size!r}; known: {list(SIZES)}")
        seconds: dict[int, list[float]] = {1: [], 2: []}
        gemm_share: dict[int, list[float]] = {1: [], 2: []}
        for round_index in range(args.rounds):
            for ranks in (1, 2) if round_index % 2 == 0 else (2, 1):
                spans, share = measure_compute(size, ranks, args.compute_repeats)
                seconds[ranks] += spans
                gemm_share[ranks].append(share)
                print(f"{size} round {round_index} {ranks} process(es): "
                      f"{statistics.median(seconds[ranks][-args.compute_repeats:]):.4f} s", file=sys.stderr, flush=True)
        one, two = statistics.median(seconds[1]), statistics.median(seconds[2])
        result: dict[str, Any] = {
            "size": size, "precision": _precision(size), "tokens_per_step": tokens_per_step,
            "compute": {"one_s": round(one, 4), "two_s": round(two, 4),
                        "one_s_per_round": [round(statistics.median(seconds[1][i:i + args.compute_repeats]), 4)
                                            for i in range(0, len(seconds[1]), args.compute_repeats)],
                        "two_s_per_round": [round(statistics.median(seconds[2][i:i + args.compute_repeats]), 4)
                                            for i in range(0, len(seconds[2]), args.compute_repeats)]},
            "gemm_share_of_operator_time": {"one": round(statistics.median(gemm_share[1]), 3),
                                            "two": round(statistics.median(gemm_share[2]), 3)},
            "ceiling_two_over_one": round(one / two, 3),
            "ideal_tokens_per_s": {"one": round(tokens_per_step / one), "two": round(tokens_per_step / two)},
            "load_avg_1m": os.getloadavg()[0]}
        if args.e2e:
            rates, notes = run_e2e(size, args)
            result["e2e_tokens_per_s"] = {name: round(rate) for name, rate in rates.items()}
            trl = {name: rate for name, rate in rates.items() if name.startswith("trl")}
            if trl:
                best = max(trl, key=trl.__getitem__)
                result["trl_best"] = best
                result["ideal_over_trl_best"] = round(tokens_per_step / two / trl[best], 3)
                # the bound if every operator but the matrix products cost nothing (and the GEMMs ran as fast)
                result["gemm_only_over_trl_best"] = round(
                    tokens_per_step / (two * statistics.median(gemm_share[2])) / trl[best], 3)
                if "hybridflow" in rates:
                    result["default_over_trl_best"] = round(rates["hybridflow"] / trl[best], 3)
            if "hybridflow" in rates and "hybridflow_1rank" in rates:
                result["trainer_two_over_one"] = round(rates["hybridflow"] / rates["hybridflow_1rank"], 3)
                result["default_over_ideal"] = round(rates["hybridflow"] / (tokens_per_step / two), 3)
                result["one_rank_over_ideal_one"] = round(rates["hybridflow_1rank"] / (tokens_per_step / one), 3)
            if notes:
                result["notes"] = notes
        results_page.result(result)


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="The GRPO step's compute ceiling on this box"))
