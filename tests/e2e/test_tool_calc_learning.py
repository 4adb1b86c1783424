"""The shipped tool task learns on CPU: SFT on the shipped multi-turn demonstrations (examples/sft_tool_calc.yaml),
then GRPO with the calculator tool (examples/grpo_tool_calc.yaml) raises the held-out score and the tool-call rate.

The SFT fixture runs 200 steps (the shipped config runs 300): the model learns to copy the operands into its call
late and suddenly (this seed's train loss 0.86 at step 120, 0.45 by 160, 0.29 at 200; after 100 or 150 steps the
GRPO run collapsed or saw reward 0, failing every assertion below). A higher lr did not make it earlier (seed 1 at
lr 0.01 on one rank: no drop by step 210, vs 160-180 at the shipped 0.003 on two) and one rank was not faster per
step (1.33 s vs 0.72 s for two ranks, run side by side; each measured once on the loaded 2-core box).
The hf run has 16 GRPO steps, validated on the 32 held-out prompts (data.val_files, 8 samples each) before the first
update and after the last (steps 0 and 16: a validation is 288 conversations, 4.5 steps' worth of rollouts, and a
reading at step 8 decided nothing the one at 16 does not; validation samples with its own seeds, so leaving it out does
not change the training run). The runs do not repeat bit for bit (the held-out reading of the same SFT config differs
in the third decimal from run to run). Measured on the AVX-512 box with a step-8 reading as well: held-out mean@8
(steps 0 -> 8 -> 16) 0.457 -> 0.738 -> 0.789, 0.445 -> 0.691 -> 0.742, 0.453 -> 0.719 -> 0.684, and after 8 steps only
0.453 -> 0.566 and 0.461 -> 0.449 (the reason for the 16); tool-call rate 0.70 at step 1 -> 0.95-1.0 over steps 13-16;
an earlier box: 0.254 -> 0.754 in 8 steps (per-step rewards swing by ±0.2: the held-out rise is the assertion that
carries the claim). Over 3 seeds x 2 engines of the shipped 30-step run, bench/tool_calc_learning.py
measures the rise. The vllm engine runs 2 steps of the same job from the same SFT model.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean, median

import pytest

from hybridflow.config import load_config
from hybridflow.tasks.tool_calc import DATA_SOURCE, save_tool_calc_model
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.sft import SFTTrainer, load_sft_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tool-calc")
    init = save_tool_calc_model(root / "init")
    config = load_sft_config(EXAMPLES / "sft_tool_calc.yaml", [
        f"model.path={init}", f"trainer.run_dir={root / 'sft'}", "trainer.progress=false",
        "trainer.tensorboard=false", "trainer.total_steps=200"])
    trainer = SFTTrainer(config, progress=False)
    return fit_and_close(trainer)


def _tool_calc_config(model: Path, run_dir: Path, engine: str, steps: int,  # type: ignore[no-untyped-def]
                      val_every: int = 0, *more: str):
    data = EXAMPLES / "data"
    return load_config(EXAMPLES / "grpo_tool_calc.yaml", [
        f"model.path={model}", f"trainer.run_dir={run_dir}", f"rollout.engine={engine}",
        f"data.train_files=[{json.dumps(str(data / 'tool_calc_train.jsonl'))}]",
        f"data.val_files=[{json.dumps(str(data / 'tool_calc_val.jsonl'))}]",
        f"trainer.total_steps={steps}", f"trainer.val_every={val_every}", "trainer.val_n=8",
        "trainer.checkpoint_every=0", "trainer.progress=false", "trainer.tensorboard=false", "trainer.resume=never",
        *more])


@pytest.mark.slow  # the module's SFT model (~90 s on a loaded 2-core box), then one GRPO step
def test_the_python_tool_is_kernel_isolated_on_the_trainers_path(sft_model: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose tools include ``python``: without bubblewrap it is refused before any worker starts (naming the
    package and the opt-in); with it, one step runs and the manifest records the boundary of each tool."""
    from hybridflow.errors import SandboxUnavailableError
    from hybridflow.tools import isolation

    # the python tool's schema joins the calculator's in the system turn: the prompts grow past the shipped 200. The
    # claim is the boundary on the trainer's path, not learning: one step of 2 prompts x 2 samples of up to 16 tokens
    # a turn, on the shipped two ranks (the SFT fixture's parked worker processes: no process to start)
    tools = ('rollout.multi_turn.tools=["calculator", "python"]', "data.max_prompt_length=400",
             "data.batch_size=2", "rollout.n=2", "rollout.max_new_tokens=16")
    isolation.isolation_status.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setenv("PATH", "/nonexistent")
            with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
                Trainer(_tool_calc_config(sft_model, tmp_path / "refused", "hf", 1, 0, *tools), progress=False)
    finally:
        isolation.isolation_status.cache_clear()
    history = fit_and_close(Trainer(_tool_calc_config(sft_model, tmp_path / "run", "hf", 1, 0, *tools),
                                    progress=False))
    assert len(history) == 1 and history[0]["actor/policy_version"] == 1.0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["tools"] == {"calculator": "in-process", "python": "bubblewrap"}


@pytest.mark.slow  # ~5 min on a loaded 2-core box: 200 SFT steps, 16 GRPO steps of 64 conversations
def test_grpo_raises_held_out_score_and_tool_use(sft_model: Path, tmp_path: Path) -> None:
    """The learning run (hf engine): the held-out mean@8 and the tool-call rate rise, the reward holds a floor."""
    # validated before the first update and after the last
    trainer = Trainer(_tool_calc_config(sft_model, tmp_path / "run", "hf", 16, val_every=16), progress=False)
    history = fit_and_close(trainer)
    held_out = [row[f"val-core/{DATA_SOURCE}/acc/mean@8"] for row in trainer.validation_history]
    assert [row["step"] for row in trainer.validation_history] == [0.0, 16.0]
    tool_rate = [metrics["tool_call_counts/mean"] for metrics in history]
    reward = [metrics["reward/mean"] for metrics in history]
    # measured 2026-12-04 (17 runs from the same SFT model, 6 of them two at a time): held-out 0.45-0.46 -> 0.63-0.73
    # (step 8) -> 0.68-0.81 (step 16) in all 17, a rise of 0.22-0.35 at step 16; one further run (the first pytest
    # run on a fresh box) read 0.46 -> 0.48 -> 0.45, whose per-step history was not kept: the message below keeps it.
    # Validated at 0 and 16 only (2026-12-07, two runs side by side from one SFT model, load ~25): 0.344 -> 0.699 and
    # 0.348 -> 0.773; tool-call rate 0.83 at step 1 -> late median 0.99 in both.
    # A learner that does not learn moves its reading by the sampling noise of 256 answers (sd ≈ 0.03 a reading)
    assert held_out[-1] >= held_out[0] + 0.15, (held_out, reward, tool_rate)
    # the rate rises by 0.1, or by half the way to 1 from a start above 0.8 (the agent loop batches conversations as
    # their tool calls return, so under load the same seeds sample differently: from 0.875 it reached 0.973 in one
    # CI run and 0.996 alone; a policy whose tool use does not rise stays near its start and fails either way). Read
    # as the median over the run's second half: a single step may dip (one CI run: 0.97 by step 6, then 0.375, 0.70,
    # 0.91, 0.98 over steps 13-16, whose mean, 0.74, the earlier form of this check took)
    late_rate, late_reward = median(tool_rate[len(tool_rate) // 2:]), median(reward[len(reward) // 2:])
    assert late_rate >= tool_rate[0] + min(0.1, (1 - tool_rate[0]) / 2), tool_rate
    assert late_rate >= 0.85, tool_rate
    # the training reward holds a floor (no collapse): it swings by ±0.2 a step, and one CI run read a late median of
    # 0.461 against 0.516 over the first four steps while its held-out score rose; the rise is the held-out check's
    assert late_reward >= 0.75 * median(reward[:4]) and late_reward >= 0.35, reward


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_engine_runs_the_tool_conversations_and_updates(sft_model: Path, tmp_path: Path) -> None:
    """The same job on the vllm engine, 2 steps: the learning itself is the hf run's (the trainer, the agent loop and
    the update are shared code) and vllm's weight handover is test_vllm_grpo's; this checks that vllm runs the
    conversations of the agent path from the SFT model: it calls the tool and some final answers are right, which a
    model that cannot multiply two-digit numbers only reaches when the calculator's result came back into its
    context. Measured once (loaded 2-core box): tool-call rate 0.40 over the 2 steps, reward 0.19 and 0.25 (below
    the hf engine's first steps, 0.73-0.78 and 0.42-0.70); asserted: ≥ 0.2 and ≥ 0.1 over 128 conversations."""
    pytest.importorskip("vllm")
    history = fit_and_close(Trainer(_tool_calc_config(sft_model, tmp_path / "run", "vllm", 2), progress=False))
    assert [m["actor/policy_version"] for m in history] == [1.0, 2.0]
    assert mean(m["tool_call_counts/mean"] for m in history) >= 0.2, history
    assert mean(m["reward/mean"] for m in history) >= 0.1, history


@pytest.mark.slow  # ~5 min+ on a loaded 2-core box: the module's SFT model, then 16 GRPO steps over the endpoint
@pytest.mark.timeout(1800)  # run alone it pays the module's SFT fixture too (10 min at a load of 25)
def test_grpo_through_an_openai_client_agent_raises_held_out_score(sft_model: Path, tmp_path: Path) -> None:
    """The same learning run with the built-in loop swapped for a user's agent (examples/agents/tool_calc_agent.py:
    the openai client, function calling, the calculator run by the agent) behind the endpoint (rollout.agent); the
    margins are the built-in loop's above (validated at steps 0 and 16 as there). The tokens trained are the
    endpoint's records: the rollout log-probs match the actor's recomputation of the trained rows. Measured
    2026-12-07 (load ~25 on the 2-core box, GRPO part 5.8 min after the SFT fixture, with a step-8 validation):
    held-out mean@8 0.379 -> 0.676 -> 0.734, tool-call rate 0.83 at step 1 -> 0.94-0.98 over steps 9-16, no failed
    agent, rollout_probs_diff_max <= 8e-6; validated at 0 and 16 only (two runs side by side, load ~30-55, another
    SFT model): 0.371 -> 0.730 and 0.402 -> 0.688, tool-call rate 0.67 and 0.77 at step 1 -> late median 0.955 and
    0.95, 0 and 1 failed agents, diff max <= 1e-5. An earlier run, whose calls past the context got a 400 instead of
    a cut completion, lost ~1 agent in 64 on 3 of its first 7 steps."""
    data = EXAMPLES / "data"
    config = load_config(EXAMPLES / "grpo_tool_calc_agent.yaml", [
        f"model.path={sft_model}", f"trainer.run_dir={tmp_path / 'run'}",
        f"rollout.agent.entry={EXAMPLES / 'agents' / 'tool_calc_agent.py'}:run",
        f"data.train_files=[{json.dumps(str(data / 'tool_calc_train.jsonl'))}]",
        f"data.val_files=[{json.dumps(str(data / 'tool_calc_val.jsonl'))}]",
        "trainer.total_steps=16", "trainer.val_every=16", "trainer.val_n=8", "trainer.checkpoint_every=0",
        "trainer.progress=false", "trainer.tensorboard=false", "trainer.resume=never",
        "actor.recompute_log_probs=true"])
    trainer = Trainer(config, progress=False)
    history = fit_and_close(trainer)
    held_out = [row[f"val-core/{DATA_SOURCE}/acc/mean@8"] for row in trainer.validation_history]
    assert [row["step"] for row in trainer.validation_history] == [0.0, 16.0]
    tool_rate = [metrics["tool_call_counts/mean"] for metrics in history]
    reward = [metrics["reward/mean"] for metrics in history]
    failed = [metrics["agent/num_failed"] for metrics in history]
    assert held_out[-1] >= held_out[0] + 0.15, (held_out, reward, tool_rate, failed)
    late_rate, late_reward = median(tool_rate[len(tool_rate) // 2:]), median(reward[len(reward) // 2:])
    assert late_rate >= tool_rate[0] + min(0.1, (1 - tool_rate[0]) / 2), tool_rate
    assert late_rate >= 0.85, tool_rate
    assert late_reward >= 0.75 * median(reward[:4]) and late_reward >= 0.35, reward
    # every agent's calls fit its context (a call is cut to the room left, and the agent ends its conversation when a
    # tool turn leaves no room: one CI run lost 3 agents to an uncaught context_length_exceeded before it did); an
    # agent past its timeout on a loaded box is a failed sample scored 0 by design, and more than two of the run's
    # 1,024 agents failing is the endpoint's fault
    assert sum(failed) <= 2, failed
    # token-exact on the trainer's path: the actor scores the trained rows as the engine did when it sampled them
    assert max(metrics["training/rollout_probs_diff_max"] for metrics in history) < 1e-3, history


@pytest.mark.slow  # the module's SFT model, then 16 GRPO steps against the environment (~1 min after the fixture)
@pytest.mark.timeout(1800)  # run alone it pays the module's SFT fixture too
def test_grpo_against_the_served_tool_calc_environment_raises_held_out_score(sft_model: Path, tmp_path: Path) -> None:
    """The same learning run with the built-in loop swapped for the tool-calc task served as an environment
    (examples/grpo_tool_calc_env.yaml: rollout.env.entry, each worker serves ToolCalcEnv over OpenEnv's WebSocket
    protocol; the environment runs the calculator and its reward is the score); the margins are the built-in loop's
    above. Measured once, 2026-12-07 (a script, same configs, load ~10 on the 2-core box; SFT 307 s, GRPO part
    51 s): held-out mean@8 0.406 -> 0.734, tool-call rate 0.73 at step 1 -> 0.97-1.0 late, no failed episode; as a
    test, alone on a quieter box: 102 s for the SFT fixture, 37 s for this test."""
    data = EXAMPLES / "data"
    config = load_config(EXAMPLES / "grpo_tool_calc_env.yaml", [
        f"model.path={sft_model}", f"trainer.run_dir={tmp_path / 'run'}",
        f"data.train_files=[{json.dumps(str(data / 'tool_calc_train.jsonl'))}]",
        f"data.val_files=[{json.dumps(str(data / 'tool_calc_val.jsonl'))}]",
        "trainer.total_steps=16", "trainer.val_every=16", "trainer.val_n=8", "trainer.checkpoint_every=0",
        "trainer.progress=false", "trainer.tensorboard=false", "trainer.resume=never"])
    trainer = Trainer(config, progress=False)
    history = fit_and_close(trainer)
    held_out = [row[f"val-core/{DATA_SOURCE}/acc/mean@8"] for row in trainer.validation_history]
    assert [row["step"] for row in trainer.validation_history] == [0.0, 16.0]
    tool_rate = [metrics["tool_call_counts/mean"] for metrics in history]
    reward = [metrics["reward/mean"] for metrics in history]
    failed = [metrics["env/num_failed"] for metrics in history]
    assert held_out[-1] >= held_out[0] + 0.15, (held_out, reward, tool_rate, failed)
    late_rate = median(tool_rate[len(tool_rate) // 2:])
    assert late_rate >= tool_rate[0] + min(0.1, (1 - tool_rate[0]) / 2) and late_rate >= 0.85, tool_rate
    # the environment runs on loopback in each worker; an episode past rollout.env.timeout_s on a loaded box is a
    # failed sample scored 0 by design, and more than two of the run's 1,024 episodes failing is the server's fault
    assert sum(failed) <= 2, failed
    assert all(metrics["reward/mean"] == pytest.approx(metrics["env/reward/mean"]) for metrics in history)
