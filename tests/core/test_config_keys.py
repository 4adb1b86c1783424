"""Every config key reaches its consumer or is refused: a walk over the whole schema.

Each leaf key of :class:`Config` — enumerated from the schema, so a key added later is walked too — is set to
non-default valid values on a config that uses every role (safe_rlhf with a KL loss: actor, rollout, critic,
reference, reward and cost models). The key passes when what the consumers receive changes: the role specs the
Trainer plans (engine configs, losses, sampling, rollout configs), its prompt loader, reward functions, KL and Lagrange
controllers, recovery policy and faults, what ``Trainer.start`` hands to Ray, the pools and the worker groups, and the
Runtime the algorithm gets. Otherwise every value tried must be refused with a ConfigError.

Ray itself is replaced by recording test doubles (``RecordingPool``, ``RecordingGroup``, ``record_init_ray``): a real
cluster per key would take minutes, and what is observed is what the trainer passes to them. The few keys that only
an algorithm's ``step`` reads are in ``STEP_READS`` with the driver code that must read them.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel
from pydantic.fields import FieldInfo

import hybridflow.controller
from hybridflow.batch import Batch
from hybridflow.config import Config, load_config
from hybridflow.errors import ConfigError, HybridflowError
from hybridflow.testing.fixtures import save_tiny_model, tiny_model_config
from hybridflow.trainer.rollout_source import ColocatedRollout

BASE = [
    "algorithm.name=safe_rlhf", "actor.kl_loss_coef=0.1", "data.task.num_prompts=16", "data.batch_size=4",
    "critic.model.preset=tiny-qwen2", "reference.model.preset=tiny-qwen2", "reward.model.preset=tiny-qwen2",
    "cost.model.preset=tiny-qwen2", "resource_pools.main.devices_per_node=[2]",
    "resource_pools.other.devices_per_node=[2]", "trainer.total_steps=40", "trainer.checkpoint_every=10",
    "trainer.val_every=5", "data.task.num_val_prompts=4",
]
#: keys read only inside an algorithm's ``step`` (no driver runs here): the source that must read each
STEP_READS = {
    "algorithm.gamma": "algorithm.gamma",
    "algorithm.lam": "algorithm.lam)",
    "algorithm.norm_adv_by_std": "algorithm.norm_adv_by_std",
    "algorithm.whiten_advantages": "if algorithm.whiten_advantages",
    # dynamic sampling happens inside Runtime.rollout, which a driver's step calls
    "algorithm.filter_groups.enable": "not spec.enable",
    "algorithm.filter_groups.metric": "metric=spec.metric",
    "algorithm.filter_groups.max_num_gen_batches": "max_num_gen_batches=spec.max_num_gen_batches",
}
#: a role section's model keys: one of path / config / preset replaces the others
MODEL_PARENTS = ("model", "actor.model", "critic.model", "reference.model", "reward.model", "cost.model",
                 "cost_critic.model", "roles.main.model", "reward.genrm.model")


# --- the schema --------------------------------------------------------------------------------------------------
def _section_type(annotation: Any) -> type[BaseModel] | None:
    candidates = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or \
        typing.get_origin(annotation) is typing.Union else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def leaf_keys(model: type[BaseModel] = Config, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every leaf key path of the schema (a dict of sections is walked through its ``main`` entry)."""
    for name, info in model.model_fields.items():
        section = _section_type(info.annotation)
        if section is not None:
            yield from leaf_keys(section, f"{prefix}{name}.")
            continue
        if typing.get_origin(info.annotation) is dict:
            value_type = _section_type(typing.get_args(info.annotation)[1])
            if value_type is not None:
                yield from leaf_keys(value_type, f"{prefix}{name}.main.")
                continue
        yield f"{prefix}{name}", info


def _current(config: Config, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node


def _generic_values(info: FieldInfo, current: Any) -> list[Any]:
    """Values to try for a key, from its type: every other choice, or a few numbers around the current one."""
    annotation = info.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    kinds = set(args) if args and typing.get_origin(annotation) is not typing.Literal else {annotation}
    if typing.get_origin(annotation) is typing.Literal:
        return [c for c in typing.get_args(annotation) if c != current] or ["not-a-choice"]
    if bool in kinds:
        return [not current]
    if int in kinds:
        base = current if isinstance(current, int) else 0
        return list(dict.fromkeys(v for v in (base + 1, 1, 2, 2 * base, 3) if v != current))
    if float in kinds:
        base = float(current) if current is not None else 0.0
        return list(dict.fromkeys(v for v in (base / 2, 0.1, 0.5, base + 0.25, 2.0) if v != current))
    if typing.get_origin(annotation) is dict:
        return [{"probe": 1}]
    raise AssertionError(f"no value to try for {annotation}; add one to special_values()")


def special_values(tmp: Path) -> dict[str, list[list[str]]]:
    """Overrides per key pattern, where the type alone gives no valid value (names, files, one-of sections)."""
    model_dir = save_tiny_model(tmp / "hf-model")
    data_file = tmp / "prompts.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": f"{i}+1=", "data_source": "probe", "reward_model": {
        "ground_truth": str(i + 1)}, "extra_info": {"index": i}}) + "\n" for i in range(8)))
    plan_dir = _write_plan(tmp / "plan")
    tiny = json.dumps(tiny_model_config(hidden_size=32))
    values: dict[str, list[list[str]]] = {  # the first matching pattern wins
        "algorithm.name": [["algorithm.name=ppo"]],
        "rollout.engine": [["rollout.engine=vllm"]],
        "*.engine": [["{key}=megatron"]],
        "*.pool": [["{key}=other"]],
        "reward.function": [["reward.function=response_length_cost"]],
        "cost.function": [["cost.function=arithmetic"]],
        # the per-call timeout applies to the worker pool: set one with it
        "reward.timeout_s": [["reward.num_workers=2", "reward.timeout_s=5"]],
        "cost.timeout_s": [["cost.num_workers=2", "cost.timeout_s=5"]],
        "reward.endpoint": [["reward.function=null", "reward.endpoint=http://127.0.0.1:9/score"]],
        "cost.endpoint": [["cost.function=null", "cost.endpoint=http://127.0.0.1:9/cost"]],
        "data.train_files": [[f"data.train_files=[{json.dumps(str(data_file))}]"]],
        "data.val_files": [[f"data.val_files=[{json.dumps(str(data_file))}]"]],
        "data.task.operators": [['data.task.operators="+-"']],
        "resource_pools.main.devices_per_node": [["resource_pools.main.devices_per_node=[4]"]],
        "trainer.run_dir": [[f"trainer.run_dir={tmp / 'other-run'}"]],
        "trainer.plan": [[f"trainer.plan={plan_dir}"]],
        # tensor and pipeline sizes > 1 need an engine declaring them (megatron); cost_critic's 1 is its default
        "cost_critic.parallel.tensor_parallel_size": [["cost_critic.engine=megatron",
                                                       "cost_critic.parallel.tensor_parallel_size=2"]],
        "cost_critic.parallel.pipeline_parallel_size": [["cost_critic.engine=megatron",
                                                         "cost_critic.parallel.pipeline_parallel_size=2"]],
        # the profile the start-up search prices: it is read with trainer.placement=auto only
        "trainer.placement_profile": [["trainer.placement=auto", "trainer.placement_profile=h100"]],
        # earlier runs the periodic advisor calibrates from: the trainer refuses them without trainer.advisor_every
        "trainer.advisor_runs": [[f"trainer.advisor_runs=[{json.dumps(str(tmp / 'earlier-run'))}]"]],
        "ray.address": [["ray.address=ray://127.0.0.1:10001"]],
        "ray.allow_remote_without_auth": [["ray.address=ray://127.0.0.1:10001",
                                           "ray.allow_remote_without_auth=true"]],
        "reliability.faults": [['reliability.faults=["actor.update@2:raise"]']],
        "reliability.deadlines": [['reliability.deadlines={"actor.update_policy": 60}']],
        "*.optim.betas": [["{key}=[0.8, 0.99]"]],
        # actor.lora needs its rank: set one with each other key
        "actor.lora.alpha": [["actor.lora.rank=4", "actor.lora.alpha=4"]],
        "actor.lora.dropout": [["actor.lora.rank=4", "actor.lora.dropout=0.1"]],
        "actor.lora.target_modules": [["actor.lora.rank=4", 'actor.lora.target_modules=["q_proj"]']],
        # on by default, also where the section is absent (cost_critic), which the generic `not current` misses
        "*.use_remove_padding": [["{key}=false"]],
        "trainer.loggers": [["trainer.loggers=[jsonl]"]],
        "rollout.multi_turn.tools": [['rollout.multi_turn.tools=["calculator"]']],
        "rollout.multi_turn.tool_options": [['rollout.multi_turn.tools=["python"]',
                                             'rollout.multi_turn.tool_options={"python": {"cpu_seconds": 2}}']],
        "rollout.multi_turn.interaction": [["rollout.multi_turn.interaction=my_package.users:make_user"]],
        # agents as code: the section needs its entry (the fixture's char tokenizer has no chat template: refused)
        "rollout.agent.entry": [["rollout.agent.entry=agent.py:run"]],
        "rollout.agent.host": [["rollout.agent.entry=agent.py:run", "rollout.agent.host=127.0.0.2"]],
    }
    env = "rollout.env.entry=hybridflow.tasks.tool_calc_env:ToolCalcEnv"  # a served environment: set one with each key
    values["rollout.env.entry"] = [[env]]
    values["rollout.env.url"] = [["rollout.env.url=http://127.0.0.1:9/env"]]
    values.update({f"rollout.env.{key}": [[env, f"rollout.env.{key}={value}"]] for key, value in (
        ("options", '{"probe": 1}'), ("tools", '["calculator"]'), ("max_turns", "2"), ("max_tokens", "64"),
        ("timeout_s", "5"), ("max_batch_rows", "4"), ("host", "127.0.0.2"), ("port", "12345"))})
    judge = "reward.genrm.model.preset=tiny-qwen2"  # the judge section needs its model: set one with each key
    values.update({f"reward.genrm.{key}": [[judge, f"reward.genrm.{key}={value}"]] for key, value in (
        ("pool", "other"), ("rollout.name", "vllm"), ("rollout.temperature", "0.5"), ("rollout.top_p", "0.5"),
        ("rollout.top_k", "3"), ("rollout.prompt_length", "64"), ("rollout.response_length", "4"),
        ("rollout.extra", '{"probe": 1}'), ("template", '"{response}?"'), ("apply_chat_template", "true"),
        ("parser", "yes_no"), ("micro_batch_size", "8"), ("timeout_s", "10"), ("failed_score", "-1"))})
    for parent in MODEL_PARENTS:  # a model section needs a source: set one with the key (same preset)
        values[f"{parent}.dtype"] = [[f"{parent}.preset=tiny-qwen2", f"{parent}.dtype=bfloat16"]]
        values[f"{parent}.path"] = [[f"{parent}.preset=null", f"{parent}.path={model_dir}"]]
        values[f"{parent}.config"] = [[f"{parent}.preset=null", f"{parent}.config={tiny}"]]
        values[f"{parent}.preset"] = [[f"{parent}.preset=tiny-llama"]]
    return values


def _write_plan(plan_dir: Path) -> Path:
    from hybridflow.placement import LLAMA_PRESETS, Workload, build_cluster, search_placements
    from hybridflow.placement.record import PLAN_FILE, plan_inputs, save_plan_record

    models = {role: LLAMA_PRESETS["7b"] for role in ("actor", "critic", "reference", "reward")}
    inputs = plan_inputs("ppo", models, build_cluster("a100", 8), Workload())
    plan = search_placements(inputs.simulator(), inputs.dataflow, inputs.models,
                             placements=[(tuple(inputs.dataflow.roles),)]).best
    plan_dir.mkdir(parents=True)
    save_plan_record(plan_dir / PLAN_FILE, inputs, plan)
    return plan_dir


def _overrides_for(key: str, info: FieldInfo, base: Config, special: dict[str, list[list[str]]]) -> list[list[str]]:
    for pattern, choices in special.items():
        if fnmatch.fnmatchcase(key, pattern):
            return [[o.replace("{key}", key) for o in choice] for choice in choices]
    return [[f"{key}={json.dumps(v)}"] for v in _generic_values(info, _current(base, key))]


# --- test doubles for Ray: record what the trainer hands over ------------------------------------------------------
class RecordingRole:
    """Test double for a role handle: each method call returns the call's name (no worker runs)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"RecordingRole({self.name})"

    def __getattr__(self, method: str) -> Any:
        return lambda *args, **kwargs: f"{self.name}.{method}"


class RecordingGroup:
    """Test double for WorkerGroup: records its construction; role handles are RecordingRole."""

    def __init__(self, pool: Any, classes: dict[str, type], **kwargs: Any) -> None:
        CALLS.append(("group", pool.name, sorted(classes), _describe(kwargs)))
        self._overrides: dict[str, dict[str, str]] = kwargs.get("protocols") or {}

    def placement(self) -> dict[str, Any]:
        return {}

    def engine_options(self) -> dict[str, Any]:
        return {}

    def protocols(self) -> dict[str, str]:
        return {f"{role}.{method}": name for role, methods in self._overrides.items() for method, name in
                methods.items()}

    def __getattr__(self, name: str) -> Any:
        return RecordingRole(name)

    def shutdown(self) -> None:
        pass

    def close(self) -> bool:
        return False


class RecordingPool:
    """Test double for ResourcePool: records its construction (placement groups need a Ray cluster)."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        self.name = name
        CALLS.append(("pool", name, _describe(kwargs)))

    def release(self) -> None:
        pass


def record_init_ray(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Test double for init_ray: records the arguments."""
    CALLS.append(("init_ray", _describe(args), _describe(kwargs)))
    return {}


CALLS: list[Any] = []


# --- what the consumers receive ----------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return repr(value.tolist())
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if type(value).__repr__ is object.__repr__:  # a plain object: its state, not its address
        state = vars(value) if hasattr(value, "__dict__") else {
            name: getattr(value, name) for name in getattr(type(value), "__slots__", ())}
        return f"{type(value).__name__}({_describe(state)})"
    return repr(value)


def observe(config: Config, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """What a Trainer built from ``config`` passes to every consumer, started on recording doubles of Ray."""
    from hybridflow.trainer import Trainer

    for directory in (run_dir, Path(config.trainer.run_dir)):
        shutil.rmtree(directory, ignore_errors=True)
    monkeypatch.setattr(hybridflow.controller, "init_ray", record_init_ray)
    monkeypatch.setattr(hybridflow.controller, "ResourcePool", RecordingPool)
    monkeypatch.setattr(hybridflow.controller, "WorkerGroup", RecordingGroup)
    CALLS.clear()
    trainer = Trainer(config, progress=None)
    try:
        dataset = trainer.loader.dataset
        seen = {
            "algorithm": _describe((trainer.algorithm.name, [plan.role for plan in trainer.plans])),
            "plans": _describe([(plan.role, plan.pool, plan.worker, plan.spec) for plan in trainer.plans]),
            "loader": _describe((dataset.input_ids, dataset.prompt_texts, dataset.ground_truths, dataset.data_sources,
                                 dataset.extra_infos, trainer.loader.batch_size, trainer.loader.seed,
                                 trainer.loader._order(0))),
            "rewards": _describe((trainer.reward_fn, trainer.cost_fn)),
            "controllers": _describe({name: item.state_dict() for name, item in trainer.algorithm_state.items()}),
            "reliability": _describe((trainer.supervisor.policy, trainer.faults)),
            "outputs": _describe((str(trainer.run_dir), trainer.checkpoints.keep, trainer.checkpoints.root,
                                  trainer.writer._tensorboard is not None, trainer.show_progress)),
            "lookahead": _describe(_lookahead_inside_a_step(trainer)),
            "validation": _describe(trainer.validation.describe() if trainer.validation is not None else None),
            "placement": _describe(trainer.auto_placement.to_json() if trainer.auto_placement is not None else None),
        }
        try:
            trainer.start()
        except HybridflowError as exc:
            seen["start"] = f"{type(exc).__name__}"
        else:
            runtime = trainer.runtime()
            seen["runtime"] = _describe({name: getattr(runtime, name) for name in runtime.__slots__
                                         if name not in ("config", "tokenizer", "state")})
            seen["old_log_probs"] = _describe(runtime.old_log_probs("generated"))
            seen["kl_rewards"] = _describe(runtime.kl_rewards(_kl_batch()))
            seen["plan_copied"] = _describe((trainer.run_dir / "plan.json").exists())
        seen["ray"] = _describe(CALLS)
        return seen
    finally:
        trainer.close()


def _lookahead_inside_a_step(trainer: Any) -> bool:
    """Whether the trainer's rollout source would submit the next generation ahead from inside its first step."""
    source = trainer.rollout_source
    if not isinstance(source, ColocatedRollout):
        return False  # a rollout pool generates ahead instead
    source._step = trainer.step
    try:
        return source.lookahead_allowed(trainer.step)
    finally:
        source._step = None


def _kl_batch() -> Batch:
    generator = torch.Generator().manual_seed(0)
    return Batch({"old_log_probs": -torch.rand(2, 3, generator=generator),
                  "ref_log_probs": -torch.rand(2, 3, generator=generator), "response_mask": torch.ones(2, 3)})


# --- the walk ----------------------------------------------------------------------------------------------------
def silent_keys(keys: list[tuple[str, FieldInfo]], tmp: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys among ``keys`` that accept a value yet change nothing any consumer receives."""
    run_dir = tmp / "run"
    base_overrides = [*BASE, f"trainer.run_dir={run_dir}"]
    base = load_config(None, base_overrides)
    special = special_values(tmp)
    baseline = observe(base, run_dir, monkeypatch)
    assert observe(base, run_dir, monkeypatch) == baseline, "the observation must be deterministic"
    silent: list[str] = []
    for key, info in keys:
        tried: list[str] = []
        refused = 0
        for overrides in _overrides_for(key, info, base, special):
            tried.append(" ".join(overrides))
            try:
                seen = observe(load_config(None, base_overrides + overrides), run_dir, monkeypatch)
            except ConfigError:
                refused += 1
                continue
            if seen != baseline:
                break
        else:
            if not tried or refused < len(tried):
                silent.append(f"{key} (tried: {'; '.join(tried) or 'nothing'})")
    return silent


def test_every_key_reaches_its_consumer_or_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [(key, info) for key, info in leaf_keys() if key not in STEP_READS]
    assert len(keys) > 100 and "actor.gradient_checkpointing" in dict(keys)
    silent = silent_keys(keys, tmp_path, monkeypatch)
    assert not silent, "keys accepted but reaching no consumer:\n  " + "\n  ".join(silent)


def test_step_reads_are_read_by_the_drivers() -> None:
    """The keys only a driver's step reads: each appears in the algorithms' source (a key no driver reads fails)."""
    import hybridflow.algorithms

    source = "\n".join(path.read_text() for path in Path(hybridflow.algorithms.__file__).parent.glob("*.py"))
    keys = dict(leaf_keys())
    for key, read in STEP_READS.items():
        assert key in keys, f"{key} is no longer a config key; drop it from STEP_READS"
        assert read in source, f"{key}: no algorithm reads it ({read!r} not found)"


def test_the_walk_reports_a_key_that_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key added to the schema that no consumer reads is found by the walk (and a real one is not)."""
    from pydantic import create_model

    import hybridflow.config

    trainer_section = create_model("ProbeTrainerConfig", __base__=hybridflow.config.TrainerConfig,
                                   unused_knob=(int, 3))
    probe_config = create_model("ProbeConfig", __base__=Config, trainer=(trainer_section, trainer_section()))
    monkeypatch.setattr(hybridflow.config, "Config", probe_config)
    walked = dict(leaf_keys(probe_config))
    assert "trainer.unused_knob" in walked
    keys = [(key, walked[key]) for key in ("trainer.unused_knob", "trainer.keep_checkpoints")]
    assert [entry.split(" ")[0] for entry in silent_keys(keys, tmp_path, monkeypatch)] == ["trainer.unused_knob"]
