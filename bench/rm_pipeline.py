"""The shipped SFT → RM → PPO pipeline (docs/guide/reward_model_training.md) as a user runs it — `hybridflow sft
examples/sft_arithmetic.yaml`, `hybridflow rm examples/rm_arithmetic.yaml`, `hybridflow train
examples/ppo_arithmetic_rm.yaml`, three CLI processes per seed — and how far PPO, scored only by the trained reward
model, raised the synthetic task's *true* preference score, which neither model ever sees.

The true score is :func:`hybridflow.tasks.preference.even_digit_share` (the share of even digits in the answer). The
bench measures it on the 20 held-out sums (never trained on by SFT, RM or PPO) for the SFT policy (PPO's start) and
for PPO's last checkpoint (`hybridflow export`), from the greedy answer and from ``--samples`` sampled answers per
sum (temperature 1, the rollout's), in this process with transformers. It also reports the answers' exact-match
accuracy on the sums (the SFT task, which the preference ignores) and the reward model's held-out pairwise accuracy.

Per seed (``trainer.seed`` of all three commands; the data splits stay the shipped ones) one ``RESULT`` line:
``rm_val_accuracy``, ``true_greedy_before/after``, ``true_sampled_before/after``, ``sum_acc_sampled_before/after``,
``rm_reward_first/last`` (PPO's mean reward-model score over its first and last 5 steps) and the three commands'
wall seconds; then a summary line with the means and the checks ``rm_accurate`` (every seed's RM ≥ 0.9 held-out
accuracy) and ``ppo_raises_true_score`` (every seed's sampled true score rises by at least ``--margin``). The script
exits 1 when a check fails.

Run: ``OMP_NUM_THREADS=1 python bench/rm_pipeline.py [--seeds 0 1 2] [--ppo-steps 40] [--margin 0.1]`` (writes
docs/benchmarks/rm_pipeline.md; ``--no-write`` prints the RESULT lines only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

import results_page

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TITLE = "SFT → RM → PPO on the synthetic preference task"


#: what Ray prints when its raylet did not register within its fixed 30 s (a box loaded by other jobs): the command
#: is started again, at most twice; any other failure stops the bench
RAY_START_TIMEOUT = "The current node timed out during startup"


def run_command(argv: list[str], log: Path) -> float:
    """Run one CLI command (its output to ``log``); its wall seconds. Exits naming the log on failure."""
    for _attempt in range(3):
        start = time.perf_counter()
        with log.open("w") as out:
            proc = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=False)
        if proc.returncode == 0:
            return time.perf_counter() - start
        if RAY_START_TIMEOUT not in log.read_text(errors="replace"):
            break
        print(f"Ray did not start for {argv[3]} ({log}); starting it again", flush=True)
    raise SystemExit(f"{' '.join(argv)} failed (exit {proc.returncode}); its output is in {log}")


def measure(model_dir: Path, *, samples: int, seed: int) -> dict[str, float]:
    """The true preference score and the sum's exact-match accuracy of ``model_dir``'s answers to the held-out sums:
    greedy, and ``samples`` sampled answers per sum (temperature 1, at most 4 new tokens as the PPO rollout)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.model_dir import load_tokenizer
    from hybridflow.tasks.arithmetic import make_sft_rows
    from hybridflow.tasks.preference import even_digit_share

    _, held_out = make_sft_rows()
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [row["prompt"] for row in held_out]
    answers = [row["response"] for row in held_out]
    encoded = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    out: dict[str, float] = {}
    torch.manual_seed(seed)
    for label, count, sampling in (("greedy", 1, False), ("sampled", samples, True)):
        options: dict[str, Any] = ({"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sampling
                                   else {"do_sample": False})
        with torch.no_grad():
            generated = model.generate(input_ids=input_ids.repeat_interleave(count, 0),
                                       attention_mask=mask.repeat_interleave(count, 0), max_new_tokens=4,
                                       pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, **options)
        texts = tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)
        truths = [answer for answer in answers for _ in range(count)]
        out[f"true_{label}"] = mean(even_digit_share(text) for text in texts)
        out[f"sum_acc_{label}"] = mean(float(text.strip() == truth) for text, truth in zip(texts, truths))
    return out


def run_seed(seed: int, work: Path, *, ppo_steps: int, samples: int) -> dict[str, Any]:
    cli = [sys.executable, "-m", "hybridflow.cli"]
    sft_dir, rm_dir, ppo_dir = work / f"sft-{seed}", work / f"rm-{seed}", work / f"ppo-{seed}"
    common = [f"trainer.seed={seed}", "trainer.tensorboard=false"]
    sft_s = run_command([*cli, "sft", str(EXAMPLES / "sft_arithmetic.yaml"), f"trainer.run_dir={sft_dir}", *common,
                         "--no-progress"], work / f"sft-{seed}.log")
    rm_s = run_command([*cli, "rm", str(EXAMPLES / "rm_arithmetic.yaml"), f"model.path={sft_dir / 'hf'}",
                        f"trainer.run_dir={rm_dir}", *common, "--no-progress"], work / f"rm-{seed}.log")
    ppo_s = run_command([*cli, "train", str(EXAMPLES / "ppo_arithmetic_rm.yaml"), f"model.path={sft_dir / 'hf'}",
                         f"reward.model.path={rm_dir / 'hf'}", f"trainer.run_dir={ppo_dir}", *common,
                         f"trainer.total_steps={ppo_steps}", f"trainer.checkpoint_every={ppo_steps}",
                         "trainer.resume=never", "--no-progress"], work / f"ppo-{seed}.log")
    run_command([*cli, "export", str(ppo_dir), str(work / f"ppo-{seed}-hf")], work / f"export-{seed}.log")
    rm_summary = json.loads((rm_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (ppo_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]
    before = measure(sft_dir / "hf", samples=samples, seed=seed)
    after = measure(work / f"ppo-{seed}-hf", samples=samples, seed=seed)
    return {"seed": seed, "rm_val_accuracy": rm_summary["validation"][-1]["val/accuracy"],
            "true_greedy_before": before["true_greedy"], "true_greedy_after": after["true_greedy"],
            "true_sampled_before": before["true_sampled"], "true_sampled_after": after["true_sampled"],
            "sum_acc_sampled_before": before["sum_acc_sampled"], "sum_acc_sampled_after": after["sum_acc_sampled"],
            "rm_reward_first": mean(rewards[:5]), "rm_reward_last": mean(rewards[-5:]),
            "sft_s": round(sft_s, 1), "rm_s": round(rm_s, 1), "ppo_s": round(ppo_s, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ppo-steps", type=int, default=40, help="PPO steps (the example's trainer.total_steps)")
    parser.add_argument("--samples", type=int, default=16, help="sampled answers per held-out sum")
    parser.add_argument("--margin", type=float, default=0.1,
                        help="the sampled true score must rise by at least this much in every seed")
    results_page.add_write_argument(parser, "rm_pipeline")
    args = parser.parse_args()
    rows = []
    work = Path(tempfile.mkdtemp(prefix="rm-pipeline-"))  # kept: the runs and their logs, for a failed command
    print(f"runs and logs in {work}", flush=True)
    for seed in args.seeds:
        row = run_seed(seed, work, ppo_steps=args.ppo_steps, samples=args.samples)
        results_page.result(row)
        rows.append(row)
    rises = [row["true_sampled_after"] - row["true_sampled_before"] for row in rows]
    checks = {"rm_accurate": all(row["rm_val_accuracy"] >= 0.9 for row in rows),
              "ppo_raises_true_score": all(rise >= args.margin for rise in rises)}
    results_page.result({
        "seeds": len(rows), "ppo_steps": args.ppo_steps, "margin": args.margin,
        "rm_val_accuracy_mean": mean(row["rm_val_accuracy"] for row in rows),
        "true_sampled_before_mean": mean(row["true_sampled_before"] for row in rows),
        "true_sampled_after_mean": mean(row["true_sampled_after"] for row in rows),
        "true_sampled_rise_min": min(rises),
        "true_greedy_before_mean": mean(row["true_greedy_before"] for row in rows),
        "true_greedy_after_mean": mean(row["true_greedy_after"] for row in rows),
        "checks": checks})
    results_page.write_page(args.write, title=TITLE, description=(
        "Per seed: the reward model's held-out pairwise accuracy; the true preference score (share of even digits in "
        "the answer, a rule neither model sees) of the policy's answers to the 20 held-out sums before PPO (the SFT "
        f"model) and after {args.ppo_steps} PPO steps scored only by the reward model, greedy and over "
        f"{args.samples} samples per sum; the sums' exact-match accuracy of the sampled answers (the preference "
        "ignores it); PPO's mean reward-model score over its first and last 5 steps; each command's wall seconds "
        "(Ray start-up included). Last row: the means, and the checks (RM >= 0.9 in every seed; sampled true score "
        f"raised by >= {args.margin} in every seed)."))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
