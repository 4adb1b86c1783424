"""The trainer: builds a run from a config, then loops ``algorithm.step`` with a ledger row, metrics and atomic
checkpoints per step, resuming bit-identically from the latest checkpoint.

The dataflow of a step is the algorithm driver's; placement is :mod:`hybridflow.trainer.build`'s.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow import registries
from hybridflow.algorithms.coefficients import ENTROPY_CONTROLLER, build_entropy_controller
from hybridflow.algorithms.roles import check_algorithm_state, load_algorithm_state
from hybridflow.algorithms.runtime import Runtime
from hybridflow.batch import Batch
from hybridflow.config import Config, check_registered_names
from hybridflow.data import PromptLoader
from hybridflow.errors import CheckpointError, ConfigError, HybridflowError
from hybridflow.ledger import Ledger
from hybridflow.manifest import build_manifest, write_manifest
from hybridflow.plugins import load_plugins
from hybridflow.reliability import FaultPlan, RecoveryPolicy, Supervisor, attach_fault_plan
from hybridflow.rewards_remote import RewardPool, build_reward_function
from hybridflow.trainer.build import Groups, build_groups, build_tokenizer, plan_roles, role_mapping, start_ray
from hybridflow.trainer.checkpoint import CheckpointManager, archive_previous_logs
from hybridflow.trainer.datasets import load_datasets
from hybridflow.trainer.iteration_record import IterationRecorder
from hybridflow.trainer.progress import MetricsWriter, Progress
from hybridflow.trainer.rollout_source import build_rollout_source
from hybridflow.trainer.rollouts import RolloutWriter
from hybridflow.trainer.timing import timing_metrics

if TYPE_CHECKING:
    from hybridflow.controller import CallObserver
    from hybridflow.placement.advisor import RunAdvisor
    from hybridflow.placement.auto import AutoPlacement

__all__ = ["Trainer"]


class Trainer:
    """One run: ``Trainer(config).fit()``. Stability: public."""

    def __init__(self, config: Config, *, progress: bool | None = None) -> None:
        self.config = config
        self.run_dir = Path(config.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        load_plugins()
        check_registered_names(config)
        self.auto_placement: AutoPlacement | None = None
        if config.trainer.placement == "auto":  # the searched plan replaces pools and parallel sizes (plan.json)
            from hybridflow.placement.auto import apply_auto_placement

            config, self.auto_placement = apply_auto_placement(config, self.run_dir)
            self.config = config
        self.algorithm = registries.algorithms.get(config.algorithm.name)
        self.tokenizer = build_tokenizer(config.role_model(config.actor))
        train, self.validation = load_datasets(config, self.tokenizer)
        self.validation_history: list[dict[str, float]] = []  # this process's validation rows, with their step
        self.loader = PromptLoader(train, batch_size=config.data.batch_size, seed=config.trainer.seed,
                                   shuffle=config.data.shuffle)
        reward, cost = config.reward, config.cost
        self.reward_fn = build_reward_function(
            reward.function, num_workers=reward.num_workers, timeout_s=reward.timeout_s, endpoint=reward.endpoint,
        ) if reward.function or reward.endpoint else None
        self.cost_fn = None
        if cost is not None and (cost.function or cost.endpoint):
            self.cost_fn = build_reward_function(cost.function, num_workers=cost.num_workers, timeout_s=cost.timeout_s,
                                                 endpoint=cost.endpoint, key="cost.function")
        # the algorithm owns its roles and state: the trainer builds, checkpoints and resumes exactly these
        self.plans = plan_roles(config, self.algorithm.roles(config), tokenizer=self.tokenizer,
                                algorithm=self.algorithm)
        self.algorithm_state = check_algorithm_state(self.algorithm.name, self.algorithm.build_state(config))
        #: adaptive entropy control (actor.entropy_target), checkpointed beside the algorithm's own state
        self.entropy_control = entropy = build_entropy_controller(config.actor)
        if entropy is not None:
            if ENTROPY_CONTROLLER in self.algorithm_state:
                raise ConfigError(f"algorithm {self.algorithm.name!r} keeps its own state named "
                                  f"{ENTROPY_CONTROLLER!r}, the name of the trainer's adaptive entropy control "
                                  "(actor.entropy_target). Fix: rename the algorithm's state")
            self.algorithm_state[ENTROPY_CONTROLLER] = entropy
        self.faults = FaultPlan.from_sources(config.reliability.faults, self.run_dir)
        self.plans = attach_fault_plan(self.plans, self.faults)
        if config.trainer.stream_mini_batches and not getattr(self.algorithm, "streams_mini_batches", False):
            raise ConfigError(f"trainer.stream_mini_batches trains a step's rollout chunk by chunk, but algorithm "
                              f"{self.algorithm.name!r} computes its advantages over the whole batch (it does not "
                              "declare streams_mini_batches). Fix: use grpo or rloo, or set "
                              "trainer.stream_mini_batches=false")
        #: where each step's generations come from (the actor's workers, or a rollout pool: rollout.pool)
        self.rollout_source, self.plans = build_rollout_source(config, self.loader, self.plans, self.validation)
        self.checkpoints = CheckpointManager(self.run_dir, keep=config.trainer.keep_checkpoints)
        self.ledger = Ledger(self.run_dir)
        loggers = [name for name in config.trainer.loggers if name != "tensorboard" or config.trainer.tensorboard]
        self.writer = MetricsWriter(self.run_dir, loggers=loggers, config=config.model_dump(mode="json"))
        self.rollouts = RolloutWriter(self.run_dir, enabled=config.trainer.log_rollouts > 0)
        self.show_progress = (config.trainer.progress if progress is None else progress) and "console" in loggers
        self.groups: Groups | None = None
        self.step = 0
        self.recorder = IterationRecorder()  # the ledger row of the iteration in flight
        self._last_step_end: float | None = None
        self.advisor: RunAdvisor | None = None  # trainer.advisor_every: the periodic placement check
        policy = RecoveryPolicy.from_config(config.reliability)
        if config.reward.genrm is not None:  # the judge's own deadline: its timeout_s and a minute to hand rows back
            policy = replace(policy, deadlines={"genrm.judge": config.reward.genrm.timeout_s + 60.0,
                                                **policy.deadlines})
        self.supervisor = Supervisor(self, policy=policy, faults=self.faults,
                                     run_dir=self.run_dir)
        #: the observers of this run's group calls (shared by its groups; append to watch them): the ledger's and
        #: recovery's. Another trainer in the process has its own list and never hears these calls.
        self.call_observers: list[CallObserver] = [self.recorder.observe, self.supervisor.observe]

    # --- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._copy_plan()
        if self.config.trainer.advisor_every or self.config.trainer.advisor_runs:  # ConfigErrors before workers
            from hybridflow.placement.advisor import RunAdvisor

            self.advisor = RunAdvisor(self.run_dir, every=self.config.trainer.advisor_every,
                                      total_steps=self.config.trainer.total_steps,
                                      calibration_runs=self.config.trainer.advisor_runs)
        started = time.perf_counter()
        start_ray(self.config.ray)
        self.groups = build_groups(self.config, self.plans, deadline_s=self.config.trainer.deadline_s,
                                   stack_dump_dir=str(self.run_dir / "stacks"), observers=self.call_observers)
        observers = [self.recorder.observe, self.supervisor.observe]
        self.rollout_source.start(self.groups, self.supervisor, observers=observers,
                                  deadline_s=self.config.trainer.deadline_s,
                                  stack_dump_dir=str(self.run_dir / "stacks"))
        protocols = self._protocols()
        mapping = role_mapping(self.config, self.plans)
        placement = {pool: group.placement() for pool, group in self.groups.by_pool.items()}
        options = {role: value for group in self.groups.by_pool.values()
                   for role, value in group.engine_options().items() if value}
        write_manifest(self.run_dir, build_manifest(self.config, protocols=protocols, mapping=mapping,
                                                    placement=placement, engine_options=options,
                                                    plan=self._plan_record()))
        if self.advisor is not None:  # the measured start-up is what a remap's restart pays
            self.advisor.setup_seconds = time.perf_counter() - started
        self._maybe_resume()

    def _plan_record(self) -> dict[str, Any]:
        """How this run's placement was chosen, for the manifest."""
        if self.auto_placement is not None:
            return self.auto_placement.to_json()
        if self.config.trainer.plan is not None:
            return {"mode": "plan", "file": str(self.config.trainer.plan)}
        return {"mode": "manual"}

    def _copy_plan(self) -> None:
        """Copy ``trainer.plan`` (a plan.json from ``hybridflow plan --output DIR``) into the run directory, where
        calibration and the remap advisor (``hybridflow plan --from-run RUN_DIR``) read it next to the ledger."""
        if self.config.trainer.plan is None:
            return
        from hybridflow.placement.record import PLAN_FILE, load_plan_record

        source = Path(self.config.trainer.plan)
        source = source / PLAN_FILE if source.is_dir() else source
        load_plan_record(source)  # ConfigError naming the file if it is missing or malformed
        target = self.run_dir / PLAN_FILE
        if not target.exists() or not target.samefile(source):
            shutil.copyfile(source, target)

    def _protocols(self) -> dict[str, str]:
        """``role.method`` → the protocol it runs with (``<role>.protocols`` overrides applied by the groups)."""
        assert self.groups is not None
        out: dict[str, str] = {}
        for group in self.groups.by_pool.values():
            out.update(group.protocols())
        return out

    def runtime(self) -> Runtime:
        assert self.groups is not None
        roles = {plan.role: self.groups.role(plan.role) for plan in self.plans}
        roles["actor"] = self.rollout_source.wrap_actor(roles["actor"])  # its generate answered by the source
        return Runtime(config=self.config, tokenizer=self.tokenizer, roles=roles,
                       state=self.algorithm_state, reward_fn=self.reward_fn, cost_fn=self.cost_fn,
                       timeout_s=self.config.trainer.deadline_s, log_rollouts=self.config.trainer.log_rollouts,
                       more_prompts=self._more_prompts, stream_chunks=self.rollout_source.stream_chunks())

    def _more_prompts(self) -> Batch:
        """The loader's next batch for this iteration (dynamic sampling draws it inside a step; a retried step
        restores the loader position first, so it draws the same prompts again)."""
        return self.loader.next_batch().with_meta(iteration=self.step, policy_version=self.step)

    def close(self) -> None:
        self.rollout_source.close()
        if self.groups is not None:
            self.groups.shutdown()
            self.groups = None
        for function in (self.reward_fn, self.cost_fn):
            if isinstance(function, RewardPool):
                function.close()
        self.writer.close()

    # --- what the Supervisor drives (hybridflow.reliability.Supervised) ------------------------------------
    def current_step(self) -> int:
        """The iteration the next :meth:`train_step` runs (the number of iterations done)."""
        return self.step

    def worker_groups(self) -> Groups:
        """The run's worker groups (after :meth:`start`)."""
        if self.groups is None:
            raise HybridflowError("the trainer has no worker groups yet: expected a started run. Fix: call start() "
                                  "(or fit()) first")
        return self.groups

    def latest_checkpoint(self, *, verify: bool = False) -> Path | None:
        """The newest published checkpoint, or None; with ``verify``, a corrupted one raises naming the file."""
        latest = self.checkpoints.latest()
        if latest is not None and verify:
            self.checkpoints.verify(latest)
        return latest

    def abandon_iteration(self) -> None:
        """Forget the iteration in flight: its ledger row (kept across retries) is not written."""
        self.recorder.record = None

    # --- checkpoints --------------------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        """The driver-side state: the data loader's position and the algorithm's state."""
        return {"loader": self.loader.state_dict(),
                "algorithm": {name: item.state_dict() for name, item in self.algorithm_state.items()}}

    def save_checkpoint(self) -> Path:
        assert self.groups is not None
        groups = self.groups

        def write_workers(path: str) -> None:
            for role in groups.role_pool:
                handle = groups.role(role)
                assert handle is not None  # role_pool lists the hosted roles
                handle.save_checkpoint(path)

        return self.checkpoints.save(self.step, write_workers, self.trainer_state(),
                                     before_publish=self.supervisor.before_publish(self.step))

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`trainer_state` returned (or a checkpoint's ``trainer_state.json``)."""
        self.loader.load_state_dict(state["loader"])
        load_algorithm_state(self.algorithm.name, self.algorithm_state, state)

    def _maybe_resume(self) -> None:
        mode = self.config.trainer.resume
        latest = self.checkpoints.latest()
        if mode == "never" or (latest is None and mode == "auto"):
            # a fresh start: rows left by an earlier run in this directory move aside instead of mixing with ours
            archive_previous_logs(self.run_dir)
            return
        if latest is None:
            raise CheckpointError(f"trainer.resume=must but {self.checkpoints.root} holds no checkpoint")
        state = self.checkpoints.verify(latest)
        assert self.groups is not None
        for role in self.groups.role_pool:
            handle = self.groups.role(role)
            assert handle is not None  # role_pool lists the hosted roles
            handle.load_checkpoint(str(latest))
        self.load_trainer_state(state)
        self.step = int(state["step"])
        self.ledger.truncate_after(self.step - 1)
        self.writer.truncate_after(self.step - 1)
        self.rollouts.truncate_after(self.step - 1)

    # --- the loop -----------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One iteration of the algorithm, recorded in the ledger and metrics (a failed attempt's nodes stay in the
        record, so the row of a retried iteration shows the lost work too)."""
        runtime = self.supervisor.wrap_runtime(self.runtime())
        prompts = self.loader.next_batch().with_meta(iteration=self.step, policy_version=self.step)
        if self.recorder.record is None or self.recorder.record.iteration != self.step:
            self.recorder.record = self.ledger.begin(self.step, policy_version=self.step)
        start = time.perf_counter()
        source, actor = self.rollout_source, self.worker_groups().role("actor")
        try:
            prompts, overlapped = source.begin_step(self.step, prompts, actor)
            metrics: dict[str, float] = self.algorithm.step(runtime, prompts)
            self._update_entropy_control(metrics)
            metrics.update(source.end_step(self.step, actor))
        except BaseException:
            source.abort_step()  # keeps what stays valid for the retry
            raise
        record, self.recorder.record = self.recorder.record, None
        self.supervisor.annotate(record, prompts)
        now = time.perf_counter()
        # with a generation submitted ahead, this step's work began before train_step did: time it end to end
        metrics["time/step_s"] = now - (self._last_step_end if overlapped and self._last_step_end else start)
        self._last_step_end = now
        tokens = metrics.get("tokens/prompt_and_response", 0.0)
        metrics["throughput/prompt_response_tokens_per_s"] = tokens / max(metrics["time/step_s"], 1e-9)
        ranks = sum(group.world_size for group in self.worker_groups().by_pool.values())
        metrics.update(timing_metrics(record.nodes, step_s=metrics["time/step_s"], tokens=tokens, ranks=ranks))
        self.recorder.record_process_stats(record, self.worker_groups())
        record.metrics = {k: float(v) for k, v in metrics.items()}
        self.ledger.commit(record)
        self.writer.write(self.step, metrics)
        self.rollouts.write(self.step, runtime.samples)
        self.step += 1
        if self.advisor is not None:
            self.advisor.after_step(self.step)  # appends its decision to RUN_DIR/advisor.jsonl when due
        return metrics

    def _update_entropy_control(self, metrics: dict[str, float]) -> None:
        """Adaptive entropy control (actor.entropy_target): steer the coefficient by the entropy this step's update
        measured (the update logged the coefficient it applied as actor/entropy_coeff)."""
        controller = self.entropy_control
        if controller is None:
            return
        if "actor/entropy" not in metrics:
            raise ConfigError(
                f"actor.entropy_target steers the entropy bonus by the entropy each update measures, but algorithm "
                f"{self.algorithm.name!r}'s step returned no actor/entropy (metrics: {', '.join(sorted(metrics))}). "
                "Fix: return the actor update's metrics from the step, or remove actor.entropy_target")
        controller.update(metrics["actor/entropy"])

    def validate_if_due(self) -> dict[str, float]:
        """Validate the current weights (policy version ``self.step``) when ``trainer.val_every`` says so; the
        metrics go to metrics.jsonl as a row of their own at this step (``val-core/...``, ``val-aux/...``)."""
        if self.validation is None or not self.validation.due(self.step, self.config.trainer.total_steps):
            return {}
        started = time.perf_counter()
        metrics = self.validation.run(self.runtime(), self.step)
        metrics["timing_s/testing"] = time.perf_counter() - started  # verl's name for validation time
        self.writer.write(self.step, metrics)
        self.validation_history.append({"step": float(self.step), **metrics})
        return metrics

    def fit(self) -> list[dict[str, float]]:
        """Run until ``trainer.total_steps``; checkpoint every ``trainer.checkpoint_every`` steps and at the end."""
        history: list[dict[str, float]] = []
        if self.groups is None:
            self.start()
        total = self.config.trainer.total_steps
        every = self.config.trainer.checkpoint_every
        with Progress(total=total, start=self.step, enabled=self.show_progress) as progress:
            self.validate_if_due()  # before training (and again on resume, as the truncated metrics lost it)
            while self.step < total:
                metrics = self.supervisor.run_iteration()  # train_step(), retried per reliability policy
                history.append(metrics)
                progress.update(self.step, metrics)
                self.validate_if_due()
                if every and (self.step % every == 0 or self.step == total):
                    self.supervisor.save_checkpoint()
        summary: dict[str, Any] = {"steps": self.step, "last": history[-1] if history else {}}
        if self.advisor is not None:
            print(self.advisor.summary(), flush=True)
            summary["advisor"] = [r.to_json() for r in self.advisor.history]
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return history
