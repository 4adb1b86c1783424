"""End-to-end GRPO throughput: hybridflow's Trainer vs TRL's GRPOTrainer on the same tiny fixture, side by side.

Fixture (issue 5): Qwen2 config hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads, tied embeddings, the
45-char vocabulary; prompts "a+b=" with a, b in [0, 99]; 16 prompts × 4 samples; 16 new tokens; the arithmetic
reward (1.0 exact, partial credit for leading digits); 1 torch thread per process; no reference model (β = 0); the
same learning rate, clip range, optimizer and group-normalised advantages on both sides.

Each system runs in its own subprocess (``--run-one``), alternating order over ``--repeats`` rounds so both see
the same machine load. A step's time is the wall time between consecutive step ends (generation, reward,
advantages, update, logging: everything); tokens per step are prompt tokens + response tokens up to and including
EOS (hybridflow: ``attention_mask.sum()``; TRL: the growth of its ``num_tokens``, the same count). Per run the
median over steps after ``--warmup`` is taken; the RESULT line holds the median over runs, the ratio of those
medians (``ratio_vs_trl``) and the median of the per-round ratios, the reward trajectories and the load seen.

TRL is not a dependency of hybridflow: ``scripts/install_trl_bench.sh`` installs TRL 1.16 and the packages it adds
(accelerate, datasets, ...) into a separate directory (default ``/work/trl-bench/site``) that only the TRL
subprocess puts on its ``PYTHONPATH`` — torch and transformers are the same as ours. ``--trl-path`` points at that
directory, ``--trl-python`` at another interpreter (e.g. a separate venv) if preferred. Without TRL the bench says
so and prints our numbers only.

``--deepspeed-zero-stage N`` adds a third system in the same rounds: hybridflow with the actor on the ``deepspeed``
engine (ZeRO stage N) instead of ``fsdp``, everything else equal; the RESULT line then holds its tokens/s beside
fsdp's (``deepspeed_*`` keys, ``deepspeed_ratio_vs_fsdp``).

``bench/e2e_sizes.py`` runs the same fixture over model sizes (:data:`SIZES`) and rank/thread configurations.

Run: ``.venv/bin/python bench/e2e_grpo.py [--steps 30] [--repeats 3] [--workers 1] [--deepspeed-zero-stage 3]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import results_page
from e2e_fixture import (
    MAX_OPERAND,
    NEW_TOKENS,
    NUM_ROWS,
    PROMPTS,
    SAMPLES,
    SIZES,
    cpu_seconds,
    model_config_of,
    peak_rss_bytes,
)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_TRL_PATH = "/work/trl-bench/site"


# --- one run of each system (in a fresh subprocess) -----------------------------------------------------------
def run_hybridflow(args: argparse.Namespace, *, engine: str = "fsdp") -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    from hybridflow.config import load_config
    from hybridflow.controller import shutdown_ray
    from hybridflow.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="e2e_grpo_")
    model = ("model.preset=tiny-qwen2-h16" if args.size == "77k"
             else f"model.config={json.dumps(model_config_of(args.size))}")
    overrides = [
        "algorithm.name=grpo", model,
        f"data.task.max_operand={MAX_OPERAND}", f"data.task.num_prompts={NUM_ROWS}", f"data.task.seed={args.seed}",
        "data.max_prompt_length=8", f"data.batch_size={PROMPTS}",
        f"resource_pools.main.devices_per_node=[{args.workers}]", f"resource_pools.main.cpus_per_worker={0.5}",
        f"actor.engine={engine}", f"actor.micro_batch_size={PROMPTS * SAMPLES}", f"actor.optim.lr={args.lr}",
        "actor.optim.warmup_steps=0", "actor.optim.grad_clip=1.0", "actor.clip_ratio_low=0.2",
        "actor.clip_ratio_high=0.2", "actor.loss_agg=token-mean",
        f"actor.recompute_log_probs={str(args.recompute_log_probs).lower()}",
        "rollout.engine=hf", f"rollout.n={SAMPLES}", "rollout.temperature=1.0", f"rollout.max_new_tokens={NEW_TOKENS}",
        f"trainer.total_steps={args.steps}", "trainer.checkpoint_every=0", f"trainer.run_dir={run_dir}",
        "trainer.progress=false", "trainer.tensorboard=false", f"trainer.threads_per_worker={args.threads}",
        f"trainer.seed={args.seed}", "trainer.resume=never", "trainer.val_every=0", *args.set,
    ]
    if engine == "deepspeed":
        overrides.append(f"actor.extra.zero_stage={args.deepspeed_zero_stage}")
    config = load_config(None, overrides)
    trainer = Trainer(config, progress=False)
    started = time.perf_counter()
    trainer.start()
    startup_s = time.perf_counter() - started
    assert trainer.groups is not None
    pids = [pid for group in trainer.groups.by_pool.values() for pid in (group.local_process_ids() or {}).values()]
    pids.append(os.getpid())  # the driver last
    ends, tokens, rewards, cpu = [time.perf_counter()], [], [], [[cpu_seconds(pid) for pid in pids]]
    try:
        for _ in range(args.steps):
            metrics = trainer.train_step()
            ends.append(time.perf_counter())
            cpu.append([cpu_seconds(pid) for pid in pids])
            tokens.append(metrics["tokens/prompt_and_response"])
            rewards.append(metrics["reward/mean"])
        assert trainer.groups is not None
        workers = [peak_rss_bytes(pid) for group in trainer.groups.by_pool.values()
                   for pid in (group.local_process_ids() or {}).values()]
    finally:
        trainer.close()
        shutdown_ray()
        if not args.keep_run_dirs:
            shutil.rmtree(run_dir, ignore_errors=True)
    return {"system": "hybridflow" if engine == "fsdp" else engine, "startup_s": startup_s,
            "step_s": [b - a for a, b in itertools.pairwise(ends)],
            # process CPU seconds (user + system) of each worker per step: robust to load, unlike wall time
            "worker_cpu_s": [[b - a for a, b in zip(before[:-1], after[:-1])]
                             for before, after in itertools.pairwise(cpu)],
            "driver_cpu_s": [after[-1] - before[-1] for before, after in itertools.pairwise(cpu)],
            "run_dir": run_dir if args.keep_run_dirs else None,
            "tokens": tokens, "rewards": rewards,
            "peak_rss_bytes": {"driver": peak_rss_bytes(), "workers": workers},
            "config": {"workers": args.workers, "threads_per_worker": args.threads, "size": args.size,
                       "training_engine": config.actor.engine,
                       "training_engine_extra": dict(config.actor.extra),
                       "rollout_engine": config.rollout.engine,
                       "recompute_log_probs": config.actor.recompute_log_probs, "overrides": list(args.set),
                       "mixed_precision": actor_precision(config)}}


def actor_precision(config: Any) -> str:
    """The actor's ``mixed_precision`` as the trainer resolves it (``auto``: hybridflow.precision)."""
    from hybridflow.precision import resolve_mixed_precision
    from hybridflow.trainer.build import build_model_spec

    return resolve_mixed_precision(config.actor.mixed_precision, engine=config.actor.engine, device="cpu",
                                   model=build_model_spec(config.actor.model or config.model, seed=0))


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    import datasets
    import transformers
    import trl
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

    from hybridflow.tasks.arithmetic import make_arithmetic_rows, score_arithmetic
    from hybridflow.testing.fixtures import build_char_tokenizer

    transformers.utils.logging.set_verbosity_error()
    rows = make_arithmetic_rows(num_rows=NUM_ROWS, max_operand=MAX_OPERAND, seed=args.seed)
    dataset = datasets.Dataset.from_list(
        [{"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"]} for row in rows])
    values = model_config_of(args.size)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))

    def arithmetic(completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
        return [score_arithmetic(c, str(g)) for c, g in zip(completions, ground_truth)]

    class Clock(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.ends = [time.perf_counter()]

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.perf_counter())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict[str, float] | None = None,
                   **__: Any) -> None:
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    output_dir = tempfile.mkdtemp(prefix="e2e_grpo_trl_")
    config = trl.GRPOConfig(
        output_dir=output_dir, use_cpu=True, per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1, num_generations=SAMPLES, max_completion_length=NEW_TOKENS,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, beta=0.0,
        epsilon=0.2, temperature=1.0, max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no",
        seed=args.seed, data_seed=args.seed, dataloader_num_workers=0, disable_tqdm=True, bf16=args.trl_bf16,
        gradient_checkpointing=args.trl_gradient_checkpointing,
    )
    clock = Clock()
    started = time.perf_counter()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[arithmetic], args=config, train_dataset=dataset,
                              processing_class=build_char_tokenizer(), callbacks=[clock])
    startup_s = time.perf_counter() - started
    try:
        trainer.train()
    finally:
        if not args.keep_run_dirs:
            shutil.rmtree(output_dir, ignore_errors=True)
    cumulative = [float(log["num_tokens"]) for log in clock.logs]
    tokens = [b - a for a, b in zip([0.0, *cumulative], cumulative)]
    return {"system": "trl", "startup_s": startup_s, "step_s": [b - a for a, b in zip(clock.ends, clock.ends[1:])],
            "tokens": tokens, "rewards": [float(log["reward"]) for log in clock.logs],
            "peak_rss_bytes": {"process": peak_rss_bytes()},
            "config": {"threads": args.threads, "size": args.size, "trl": trl.__version__,
                       "transformers": transformers.__version__, "loss_type": config.loss_type,
                       "scale_rewards": config.scale_rewards}}


# --- the driver -------------------------------------------------------------------------------------------------
def summarize_run(run: dict[str, Any], warmup: int) -> dict[str, Any]:
    steps = run["step_s"][warmup:] or run["step_s"]
    tokens = run["tokens"][warmup:] or run["tokens"]
    rates = [t / s for t, s in zip(tokens, steps)]
    summary = {"step_s_median": statistics.median(steps), "prompt_response_tokens_per_s": statistics.median(rates),
               "tokens_per_step_median": statistics.median(tokens)}
    cpu = run.get("worker_cpu_s")
    if cpu:  # hybridflow: each worker's median CPU seconds per step
        kept = cpu[warmup:] or cpu
        summary["worker_cpu_s_per_step_median"] = [round(statistics.median(step[w] for step in kept), 4)
                                                   for w in range(len(kept[0]))]
        # the mean over the kept steps resolves below /proc's 10 ms clock tick, which a median per step cannot
        driver = run.get("driver_cpu_s") or []
        summary["cpu_s_per_step_mean"] = {
            "workers": [round(statistics.mean(step[w] for step in kept), 4) for w in range(len(kept[0]))],
            "driver": round(statistics.mean(driver[warmup:] or driver), 4) if driver else None}
    return summary


def launch(system: str, args: argparse.Namespace) -> dict[str, Any] | str:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    python = sys.executable
    if system == "trl":
        python = args.trl_python or sys.executable
        if args.trl_path:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (args.trl_path, env.get("PYTHONPATH", "")) if p)
    command = [python, __file__, "--run-one", system, "--steps", str(args.steps), "--workers", str(args.workers),
               "--lr", str(args.lr), "--seed", str(args.seed), "--size", args.size, "--threads", str(args.threads),
               "--recompute-log-probs" if args.recompute_log_probs else "--no-recompute-log-probs",
               "--deepspeed-zero-stage", str(args.deepspeed_zero_stage),
               "--trl-bf16" if args.trl_bf16 else "--no-trl-bf16",
               "--trl-gradient-checkpointing" if args.trl_gradient_checkpointing else "--no-trl-gradient-checkpointing"]
    if args.keep_run_dirs:
        command.append("--keep-run-dirs")
    for item in args.set:
        command += ["--set", item]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        return f"{system}: timed out after {args.timeout_s} s"
    for line in done.stdout.splitlines():
        if line.startswith("ONE "):
            return json.loads(line[4:])  # type: ignore[no-any-return]
    return f"{system}: exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}"


def run_rounds(plans: dict[str, tuple[str, argparse.Namespace]], repeats: int, warmup: int, notes: list[str],
               label: str = "") -> tuple[dict[str, list[dict[str, Any]]], list[float]]:
    """Launch every plan (name → the ``--run-one`` system and its arguments) once a round for ``repeats`` rounds, the
    order reversed every other round; returns each name's runs (with their ``summary``) and the 1-minute load average
    before each launch. A failed run is noted in ``notes`` and left out."""
    names = list(plans)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    loads: list[float] = []
    for round_index in range(repeats):
        for name in names if round_index % 2 == 0 else names[::-1]:
            system, args = plans[name]
            loads.append(os.getloadavg()[0])
            outcome = launch(system, args)
            if isinstance(outcome, str):
                note = outcome if name == system else f"{name}: {outcome}"
                notes.append(note)
                print(f"NOTE {note}", file=sys.stderr)
                continue
            outcome["summary"] = summarize_run(outcome, warmup)
            runs[name].append(outcome)
            print(f"{label}round {round_index} {name}: {json.dumps(outcome['summary'])} load {loads[-1]:.1f}",
                  file=sys.stderr, flush=True)
    return runs, loads


def trl_available(args: argparse.Namespace) -> str | None:
    """None when TRL imports in the TRL subprocess's environment, else why not."""
    env = dict(os.environ)
    if args.trl_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.trl_path, env.get("PYTHONPATH", "")) if p)
    probe = subprocess.run([args.trl_python or sys.executable, "-c", "import trl; print(trl.__version__)"], env=env,
                           capture_output=True, text=True, timeout=300)
    if probe.returncode:
        return (f"TRL is not importable (python {args.trl_python or sys.executable}, path {args.trl_path}): "
                f"{probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode}; run "
                "scripts/install_trl_bench.sh")
    return None


def median_trajectory(runs: list[dict[str, Any]]) -> list[float]:
    length = min(len(r["rewards"]) for r in runs)
    return [round(statistics.median(r["rewards"][i] for r in runs), 4) for i in range(length)]


def add_shared_arguments(parser: argparse.ArgumentParser) -> None:
    """The options this bench and ``bench/e2e_sizes.py`` share (each run of either goes through :func:`launch`)."""
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs every system once")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate of both systems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recompute-log-probs", action=argparse.BooleanOptionalAction, default=False,
                        help="hybridflow: recompute π_old with the training engine (TRL does not: one update per "
                             "generation, π_old = π)")
    parser.add_argument("--trl-path", default=DEFAULT_TRL_PATH if Path(DEFAULT_TRL_PATH).exists() else "",
                        help="directory with TRL and its extra packages, prepended to PYTHONPATH of the TRL run")
    parser.add_argument("--trl-bf16", action=argparse.BooleanOptionalAction, default=False,
                        help="TRL in bf16 autocast (TRL's default; off: fp32); our auto is bf16 from 1M params")
    parser.add_argument("--trl-gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="TRL's activation checkpointing (its GRPOConfig default: on)")
    parser.add_argument("--trl-python", default="", help="interpreter of the TRL run (default: this one)")
    parser.add_argument("--set", action="append", default=[], help="extra hybridflow config override key=value")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--keep-run-dirs", action="store_true", help="keep each run's directory (ledger, metrics)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--workers", type=int, default=1, help="hybridflow actor ranks (resource_pools.main)")
    parser.add_argument("--systems", default="hybridflow,trl")
    add_shared_arguments(parser)
    parser.add_argument("--deepspeed-zero-stage", type=int, default=0, choices=(0, 1, 2, 3),
                        help="also run the actor on the deepspeed engine at this ZeRO stage in the same rounds and "
                             "print its tokens/s beside fsdp's (0: off)")
    parser.add_argument("--size", default="77k", choices=tuple(SIZES), help="model size (default: the 77K fixture)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (hybridflow: per worker)")
    parser.add_argument("--sizes", nargs="?", const="", default=None, help=argparse.SUPPRESS)  # moved to e2e_sizes.py
    parser.add_argument("--run-one", choices=("hybridflow", "trl", "deepspeed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sizes is not None:
        raise SystemExit("bench/e2e_grpo.py --sizes: the per-size grid is its own script now; expected "
                         "bench/e2e_sizes.py [--sizes 2.4m,20m]")
    if args.run_one:
        if args.run_one == "trl":
            result = run_trl(args)
        else:
            result = run_hybridflow(args, engine="fsdp" if args.run_one == "hybridflow" else "deepspeed")
        print("ONE " + json.dumps(result), flush=True)
        return

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.deepspeed_zero_stage and "deepspeed" not in systems:
        systems.insert(1 if "hybridflow" in systems else 0, "deepspeed")
    notes: list[str] = []
    if "trl" in systems:
        why = trl_available(args)
        if why:
            notes.append(why)
            systems.remove("trl")
            print(f"NOTE {why}; printing hybridflow numbers only", file=sys.stderr)
    runs, loads = run_rounds({system: (system, args) for system in systems}, args.repeats, args.warmup, notes)
    result: dict[str, Any] = {"fixture": {"model": "qwen2 h64 i128 L2 heads4 kv2 tied, char vocab 45",
                                          "prompts": PROMPTS, "samples": SAMPLES, "new_tokens": NEW_TOKENS,
                                          "max_operand": MAX_OPERAND, "threads_per_process": 1, "lr": args.lr,
                                          "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats},
                              "load_avg_1m": {"min": min(loads, default=0.0), "median": statistics.median(loads or [0]),
                                              "max": max(loads, default=0.0), "cpus": os.cpu_count()}}
    for system, system_runs in runs.items():
        if not system_runs:
            continue
        key = {"hybridflow": "", "trl": "trl_", "deepspeed": "deepspeed_"}[system]
        result[f"{key}step_s_median"] = statistics.median(r["summary"]["step_s_median"] for r in system_runs)
        result[f"{key}prompt_response_tokens_per_s"] = statistics.median(
            r["summary"]["prompt_response_tokens_per_s"] for r in system_runs)
        result[f"{key}tokens_per_s_per_run"] = [round(r["summary"]["prompt_response_tokens_per_s"])
                                                for r in system_runs]
        result[f"{key}reward_per_step"] = median_trajectory(system_runs)
        result[f"{key}startup_s_median"] = statistics.median(r["startup_s"] for r in system_runs)
        result[f"{key}config"] = system_runs[0]["config"]
        if "worker_cpu_s_per_step_median" in system_runs[0]["summary"]:
            result[f"{key}worker_cpu_s_per_step_per_run"] = [r["summary"]["worker_cpu_s_per_step_median"]
                                                             for r in system_runs]
            result[f"{key}cpu_s_per_step_mean_per_run"] = [r["summary"]["cpu_s_per_step_mean"] for r in system_runs]
        if system_runs[0].get("run_dir"):
            result[f"{key}run_dirs"] = [r["run_dir"] for r in system_runs]
    if runs.get("hybridflow") and runs.get("deepspeed"):
        result["deepspeed_ratio_vs_fsdp"] = (result["deepspeed_prompt_response_tokens_per_s"]
                                             / result["prompt_response_tokens_per_s"])
    if runs.get("hybridflow") and runs.get("trl"):
        result["ratio_vs_trl"] = result["prompt_response_tokens_per_s"] / result["trl_prompt_response_tokens_per_s"]
        paired = [a["summary"]["prompt_response_tokens_per_s"] / b["summary"]["prompt_response_tokens_per_s"]
                  for a, b in zip(runs["hybridflow"], runs["trl"])]
        result["ratio_vs_trl_per_round"] = [round(r, 3) for r in paired]
        for system in ("hybridflow", "trl"):
            trajectory = result["reward_per_step" if system == "hybridflow" else "trl_reward_per_step"]
            half = max(1, len(trajectory) // 3)
            result[f"{'' if system == 'hybridflow' else 'trl_'}reward_gain_first_to_last_third"] = round(
                statistics.mean(trajectory[-half:]) - statistics.mean(trajectory[:half]), 4)
    if notes:
        result["notes"] = notes
    results_page.result(result)


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="End-to-end GRPO throughput: hybridflow vs TRL"))
