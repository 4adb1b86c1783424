"""On-policy distillation through the trainer (``algorithm.name: on_policy_distill``, the shipped example): a teacher
trained on the main job's arithmetic task (the shipped SFT warm start, in this module's fixture) and an untrained
student (random init); the student samples, the teacher scores every sampled token on a pool of its own, and the
student's reverse KL to the teacher falls while the teacher's log-probability of the student's samples rises. With
the advantage's sign flipped (the mutant of ``compute_distillation_advantages``) both move the other way and the
test fails (checked by hand once, 2026-12-07: the per-response reverse KL rose 27 → 47 instead of falling).
Measured 2026-12-07 on the shared 2-core box (~4.5 min with the teacher's SFT): per-response reverse KL 24.6 → 4.6
(first / last 5 steps), per-token 3.34 → 2.05, the teacher's log-prob of the student's samples −7.1 → −4.0. The
untrained student's held-out exact match does not move in 30 steps (0.0; the teacher's is 0.25), so this test
checks the divergence, not the accuracy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.ledger import read_ledger
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.rollouts import read_rollouts
from hybridflow.trainer.sft import SFTTrainer, load_sft_config

ROOT = Path(__file__).resolve().parents[2]
SFT_EXAMPLE = ROOT / "examples" / "sft_arithmetic.yaml"
DISTILL_EXAMPLE = ROOT / "examples" / "distill_arithmetic.yaml"
ACC = "val-core/hybridflow/arithmetic/acc/mean@1"
TEACHER_SFT_STEPS, DISTILL_STEPS = 60, 30


def sft(run_dir: Path, steps: int) -> tuple[Path, list[dict[str, float]]]:
    config = load_sft_config(SFT_EXAMPLE, [f"trainer.run_dir={run_dir}", "trainer.tensorboard=false",
                                           "trainer.progress=false", f"trainer.total_steps={steps}",
                                           f"trainer.val_every={steps}"])
    trainer = SFTTrainer(config)
    target = fit_and_close(trainer)
    return target, trainer.validation_history


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The shipped SFT of the main job's task (60 steps: held-out greedy accuracy 0.05-0.25, random init's is 0)."""
    path, validation = sft(tmp_path_factory.mktemp("teacher") / "sft", TEACHER_SFT_STEPS)
    return {"path": path, "validation": validation}


def distill_config(run_dir: Path, teacher: Path, *overrides: str) -> Any:
    return load_config(DISTILL_EXAMPLE, [
        f"roles.teacher.model.path={teacher}", f"trainer.run_dir={run_dir}", "trainer.progress=false",
        "trainer.tensorboard=false", "trainer.resume=never", "trainer.checkpoint_every=0", *overrides])


@pytest.fixture(scope="module")
def distill_run(teacher: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The shipped example, shortened, with a student from random init (model.preset) and the teacher on its own
    pool."""
    run_dir = tmp_path_factory.mktemp("distill") / "run"
    config = distill_config(run_dir, teacher["path"], "model.path=null", "model.preset=tiny-qwen2",
                            "actor.optim.lr=0.003", f"trainer.total_steps={DISTILL_STEPS}",
                            f"trainer.val_every={DISTILL_STEPS}")
    trainer = Trainer(config, progress=False)
    history = fit_and_close(trainer)
    return {"history": history, "validation": trainer.validation_history, "run_dir": run_dir,
            "teacher_validation": teacher["validation"]}


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_student_reverse_kl_to_the_teacher_falls(distill_run: dict[str, Any]) -> None:
    history = distill_run["history"]
    kl = [m["distill/reverse_kl"] for m in history]
    kl_seq = [m["distill/reverse_kl_seq"] for m in history]
    teacher_lp = [m["distill/teacher_log_prob"] for m in history]
    # the teacher knows the task the untrained student does not (held-out greedy exact match, 20 sums)
    validation = distill_run["validation"]
    assert [row["step"] for row in validation] == [0, DISTILL_STEPS]
    assert distill_run["teacher_validation"][-1][ACC] > validation[0][ACC], validation
    # the per-response reverse KL (the student also learns to stop where the teacher does) and the per-token one
    assert mean(kl_seq[-5:]) < 0.5 * mean(kl_seq[:5]), kl_seq
    assert mean(kl[-5:]) < 0.9 * mean(kl[:5]), kl
    # the teacher finds the student's samples likelier (log-prob per token)
    assert mean(teacher_lp[-5:]) > mean(teacher_lp[:5]) + 1.0, teacher_lp
    # the teacher scored every rollout: a node of its own in the ledger, on its own pool
    ledger = read_ledger(distill_run["run_dir"])
    assert all("teacher.compute_ref_log_probs" in row["nodes"] for row in ledger)
    manifest = json.loads((distill_run["run_dir"] / "manifest.json").read_text())
    assert manifest["algorithm"] == "on_policy_distill" and set(manifest["mapping"]) >= {"actor", "teacher"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_colocated_teacher_scores_the_students_own_tokens_and_adds_the_task_advantage(
        teacher: dict[str, Any], tmp_path: Path) -> None:
    """The teacher colocated with the actor (pool main) and equal to the student: its log-probs of the sampled
    tokens (the reference engine's forward) equal the rollout's own, so the reverse KL is 0 — an off-by-one or
    another model would not be — and with use_task_rewards each row's advantage is GRPO's of its reward."""
    run_dir = tmp_path / "run"
    config = distill_config(run_dir, teacher["path"], f"model.path={teacher['path']}", "roles.teacher.pool=main",
                            "algorithm.extra.use_task_rewards=true", "trainer.total_steps=1", "trainer.val_every=0",
                            "data.task.num_val_prompts=0", "trainer.log_rollouts=64")
    history = fit_and_close(Trainer(config, progress=False))
    # one step: the rollout is the student before any update, i.e. the teacher's own model
    (metrics,) = history
    assert abs(metrics["distill/reverse_kl"]) < 1e-4, metrics  # measured 1.4e-8
    assert metrics["distill/teacher_log_prob"] < -0.01  # a sampled, not a certain, answer
    groups: dict[str, list[dict[str, Any]]] = {}
    for sample in read_rollouts(run_dir):
        groups.setdefault(f"{sample['step']}/{sample['uid']}", []).append(sample)
    assert len(groups) == 16 and any(len({s["reward"] for s in group}) > 1 for group in groups.values())
    for group in groups.values():
        rewards = torch.tensor([s["reward"] for s in group])
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        assert [s["advantage"] for s in group] == pytest.approx(expected.tolist(), abs=1e-3), group
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["mapping"]["teacher"]["pool"] == manifest["mapping"]["actor"]["pool"] == "main"
