"""Mutation check (issue #41): do the fast tests catch a broken learner?

Each *mutant* is one known-bad change to the learner, written as a small textual patch (an exact snippet of a named
source file and its replacement): PPO clipping off, the advantage's sign flipped, the ratio taken against the policy
being trained (π_old := π, ratio ≡ 1), the KL and entropy terms' signs flipped, the loss aggregated over the wrong
axis, one FSDP rank skipping its optimizer step, the actor handing the rollout stale weights, tensor-parallel shards
handed to the wrong tensor rank, the reward model's pairwise loss with its sign flipped. The shared tree is never
written: the script makes one throw-away copy of the working tree (tracked and untracked-but-not-ignored files; a
committed tree with ``--source git:REF``) in a temporary directory and, for each mutant, applies the patch there,
runs a small, targeted set of fast tests of the default suite against the copy (``PYTHONPATH`` puts the copy's
``core/`` and ``plugins/*`` ahead of the editable installs; the Ray workers and spawned gloo ranks the tests start
inherit it, and the script checks that ``hybridflow`` resolves to the copy) and restores the file. A mutant is
*caught* when a selected test fails (or errors, or the run times out), *survived* when they all pass: a surviving
mutant is a hole in the suite. Each mutant's tests come in two tiers, reported apart: *component* tests (the changed
code on hand-made inputs, engine contracts) and *learning* tests (RL updates of a tiny model through the FSDP engine
or the trainer). A baseline run of every selected test on the unmutated copy comes first; if one of them fails there,
no mutant's result would mean anything and the script stops.

One ``RESULT {json}`` line per mutant on stdout (name, file, tests run, caught, caught_by_component,
caught_by_learning, the failing tests, seconds); ``--write PATH`` writes a markdown table with the date, machine,
load and command (docs/benchmarks/mutation_check.md is that file).

Run (the whole list: 11 minutes on the 2-core box at a load average of 1-3.5, 28 minutes while other jobs kept it
near 30; about 5 of them are the stale-weights mutant, whose failures the trainer's recovery retries; not part of
scripts/test.sh)::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/mutation_check.py                   # every mutant
    OMP_NUM_THREADS=1 .venv/bin/python scripts/mutation_check.py --only clip_off,ratio_against_new_policy
    OMP_NUM_THREADS=1 .venv/bin/python scripts/mutation_check.py --list            # names, files, tests
    OMP_NUM_THREADS=1 .venv/bin/python scripts/mutation_check.py --source git:HEAD~1   # a committed tree
    OMP_NUM_THREADS=1 .venv/bin/python scripts/mutation_check.py --write docs/benchmarks/mutation_check.md

A patch whose snippet no longer occurs exactly once in its file (the code moved on) is reported as not run, in its
RESULT line and the table, and the script exits 1 after the other mutants: update the snippet, never drop the mutant
silently. A test named in a selection that the copy lacks (an older ``--source``) is skipped and reported as
missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import results_page  # noqa: E402  (bench/results_page.py: the benches' machine line)

PLUGINS = ("fsdp", "megatron", "vllm", "sglang", "deepspeed")
#: what a copy needs to run the tests (docs and README are read by a few tests too)
COPIED = ("core", "plugins", "tests", "examples", "scripts", "bench", "docs", "pyproject.toml", "README.md")

# --- the tests the mutants are run against, by what they exercise ------------------------------------------------
LOSS_UNITS = ("tests/core/algorithms/test_losses.py", "tests/core/algorithms/test_policy_loss_modes.py",
              "tests/core/algorithms/test_actor_kl_loss.py")
ADVANTAGE_UNITS = ("tests/core/algorithms/test_advantages.py",)
#: the from-scratch learning test: 40 GRPO steps whose reward must rise, one optimizer step per rollout
GRPO_LEARNS = "tests/e2e/test_train.py::test_grpo_reward_rises"
#: a 3-step run steering the entropy bonus, and a one-step run per non-vanilla policy loss with two epochs
ENTROPY_RUN = "tests/e2e/test_train.py::test_adaptive_entropy_control_steers_the_coefficient_the_workers_apply"
LOSS_MODE_RUNS = "tests/e2e/test_policy_loss_train.py"
#: issue #41's learning-path tests: PPO updates that take several off-policy mini-batches, through the FSDP engine
#: (clip, entropy and KL terms against their formulas) and through the trainer (2 PPO steps, 2 FSDP ranks)
ENGINE_PPO = "tests/plugins/fsdp/test_ppo_update.py"
TRAINER_PPO = "tests/e2e/test_ppo_mini_batches_train.py"
TWO_RANKS_MATCH_ONE = "tests/plugins/fsdp/test_contracts.py::test_two_ranks_match_one_rank"
#: the tensor-parallel layouts and the reshard executor (the trainer at tg = 2 is a slow test: not selected)
TENSOR_PARALLEL = ("tests/plugins/fsdp/test_tp_generation.py", "tests/core/resharding/test_reshard_executor.py")
#: issue #43: the reward model's loss on hand-made rewards, and `hybridflow rm` learning the synthetic preference
RM_UNITS = "tests/core/trainer/test_rm_data.py"
RM_LEARNS = "tests/core/trainer/test_rm_trainer.py::test_reward_model_learns_the_hidden_preference_on_held_out_pairs"


@dataclass(frozen=True, kw_only=True, slots=True)
class Mutant:
    """A known-bad change: ``old`` (which must occur exactly once in ``file``) replaced by ``new``; the tests meant
    to catch it, in two tiers: ``component`` (the changed code on hand-made inputs, engine contracts) and
    ``learning`` (RL updates of a tiny model through the engine or the trainer)."""

    name: str
    what: str
    file: str
    old: str
    new: str
    component: tuple[str, ...]
    learning: tuple[str, ...]

    @property
    def tests(self) -> tuple[str, ...]:
        return (*self.component, *self.learning)


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="clip_off", what="PPO's ratio not clipped (the clipped term is -A·ratio)",
        file="core/hybridflow/algorithms/loss_terms.py",
        old=("    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)\n"
             "    losses = torch.maximum(unclipped, clipped)\n    clip_active = clipped > unclipped\n"),
        new=("    clipped = -advantages * ratio\n"
             "    losses = torch.maximum(unclipped, clipped)\n    clip_active = clipped > unclipped\n"),
        component=LOSS_UNITS, learning=(GRPO_LEARNS, LOSS_MODE_RUNS, ENGINE_PPO, TRAINER_PPO),
    ),
    Mutant(
        name="advantage_sign", what="GRPO's advantage sign flipped (group mean - score)",
        file="core/hybridflow/algorithms/advantages.py",
        old="    advantages = scores - mean\n", new="    advantages = mean - scores\n",
        component=ADVANTAGE_UNITS, learning=(GRPO_LEARNS, TRAINER_PPO),
    ),
    Mutant(
        name="ratio_against_new_policy", what="the ratio's π_old is the policy being trained (ratio == 1)",
        file="core/hybridflow/algorithms/losses.py",
        old='old_log_probs = _column(micro_batch, "old_log_probs", "log-probs of the policy that sampled the batch")',
        new="old_log_probs = log_probs.detach()",
        component=LOSS_UNITS, learning=(GRPO_LEARNS, LOSS_MODE_RUNS, ENGINE_PPO, TRAINER_PPO),
    ),
    Mutant(
        name="kl_loss_sign", what="the KL-to-reference loss subtracted instead of added",
        file="core/hybridflow/algorithms/losses.py",
        old="            loss = loss + config.kl_loss_coef * aggregate_loss(",
        new="            loss = loss - config.kl_loss_coef * aggregate_loss(",
        component=LOSS_UNITS, learning=(GRPO_LEARNS, ENGINE_PPO, TRAINER_PPO),
    ),
    Mutant(
        name="kl_reward_sign", what="the in-reward KL penalty added to the reward instead of subtracted",
        file="core/hybridflow/algorithms/advantages.py",
        old="        rewards = rewards - kl_coef * _zero_padding(kl.to(dtype), response_mask)\n",
        new="        rewards = rewards + kl_coef * _zero_padding(kl.to(dtype), response_mask)\n",
        component=ADVANTAGE_UNITS, learning=(GRPO_LEARNS, TRAINER_PPO),
    ),
    Mutant(
        name="entropy_sign", what="the entropy bonus added to the loss (entropy penalised)",
        file="core/hybridflow/algorithms/losses.py",
        old="                loss = loss - entropy_coef * entropy_bonus(",
        new="                loss = loss + entropy_coef * entropy_bonus(",
        component=LOSS_UNITS, learning=(GRPO_LEARNS, ENTROPY_RUN, ENGINE_PPO, TRAINER_PPO),
    ),
    Mutant(
        name="token_mean_over_batch_first", what="token-mean taken over the batch dim first (per position, then "
        "over positions)",
        file="core/hybridflow/algorithms/loss_terms.py",
        old="        return (loss_matrix * weights).sum(), weights.sum()\n",
        new=("        return ((loss_matrix * weights).sum(dim=0) / weights.sum(dim=0).clamp(min=1)).sum(), "
             "(weights.sum(dim=0) > 0).to(loss_matrix.dtype).sum()\n"),
        component=LOSS_UNITS, learning=(GRPO_LEARNS, ENGINE_PPO, TRAINER_PPO),
    ),
    Mutant(
        name="optimizer_step_skipped_on_rank1", what="FSDP rank 1 skips optimizer.step() (its version still counts)",
        file="plugins/fsdp/hybridflow_fsdp/training.py",
        old="        if math.isfinite(norm_value):\n            self.optimizer.step()\n",
        new=("        if math.isfinite(norm_value):\n"
             "            if self.rank != 1:\n                self.optimizer.step()\n"),
        component=(TWO_RANKS_MATCH_ONE,), learning=(GRPO_LEARNS, TRAINER_PPO),
    ),
    Mutant(
        name="stale_rollout_weights", what="the actor worker hands weights to the rollout only once (_sync_weights "
        "returns early after the first handover)",
        file="core/hybridflow/workers/roles.py",
        old='        """Reshard the training weights into the rollout engine if it holds an older version."""\n',
        new=('        """Reshard the training weights into the rollout engine if it holds an older version."""\n'
             '        if self.handover["count"]:\n            return\n'),
        component=(), learning=(GRPO_LEARNS, TRAINER_PPO),
    ),
    Mutant(
        name="tensor_shards_swapped", what="the handover's generation layout gives tensor rank k shard tg-1-k",
        file="core/hybridflow/resharding/specs.py",
        old="            parts, part = mesh.axis_size(axis), mesh.axis_index(rank, axis)\n",
        new=("            parts, part = mesh.axis_size(axis), mesh.axis_index(rank, axis)\n"
             '            if axis == "tensor" and isinstance(mesh, GenerationLayout):\n'
             "                part = parts - 1 - part\n"),
        component=TENSOR_PARALLEL, learning=(),
    ),
    Mutant(
        name="rm_loss_sign", what="the reward model's Bradley-Terry loss takes r_r - r_c (prefers the rejected side)",
        file="core/hybridflow/trainer/rm_loss.py",
        old="    difference = chosen - rejected\n", new="    difference = rejected - chosen\n",
        component=(RM_UNITS,), learning=(RM_LEARNS,),
    ),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """One pytest run over a copy: exit status, the selected tests that failed or errored, seconds."""

    rc: int
    failed: tuple[str, ...]
    seconds: float
    timed_out: bool = False


def make_copy(source: str, destination: Path) -> str:
    """Fill ``destination`` with the tree to mutate; return a description of where it came from."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    if source == "worktree":
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                                capture_output=True, check=True).stdout.decode().split("\0")
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True,
                                    check=True).stdout.strip())
        for name in listed:
            path = ROOT / name
            if not name or not name.startswith(COPIED) or not path.is_file():  # deleted in the tree: not copied
                continue
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        return f"working tree at {commit}{' with uncommitted changes' if dirty else ''}"
    if not source.startswith("git:"):
        raise SystemExit(f"--source must be worktree or git:REF, got {source!r}")
    ref = source[len("git:"):]
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref, *COPIED], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)
    resolved = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True,
                              check=True).stdout.strip()
    return f"git {ref} ({resolved})"


def copy_environment(copy: Path) -> dict[str, str]:
    """The environment a test run over ``copy`` needs: its packages first on the path, one thread per process."""
    paths = [str(copy / "core"), *(str(copy / "plugins" / name) for name in PLUGINS)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports_resolve_to(copy: Path, env: dict[str, str]) -> None:
    """The copy's packages, not the shared tree's editable installs, are what a test process imports."""
    probe = ("import hybridflow, hybridflow_fsdp; print(hybridflow.__file__); print(hybridflow_fsdp.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=env, capture_output=True, text=True, check=True)
    for line in out.stdout.split():
        if not Path(line).resolve().is_relative_to(copy.resolve()):
            raise SystemExit(f"the test processes would import {line}, not the copy under {copy}: mutants would not "
                             "be seen; check the editable installs' finders")


def existing(copy: Path, tests: Sequence[str]) -> tuple[list[str], list[str]]:
    """(selected tests whose file the copy has, those it lacks)."""
    present: list[str] = []
    missing: list[str] = []
    for test in tests:
        (present if (copy / test.split("::")[0]).is_file() else missing).append(test)
    return present, missing


def run_tests(copy: Path, env: dict[str, str], tests: Sequence[str], *, timeout_s: float,
              per_test_timeout_s: int) -> Outcome:
    """pytest over ``tests`` in ``copy``; the failures read from its JUnit XML report."""
    with tempfile.TemporaryDirectory(prefix="mutation-report-") as scratch:
        report = Path(scratch) / "report.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
                   f"timeout={per_test_timeout_s}", f"--junitxml={report}", *tests]
        started = time.perf_counter()
        # its own session, so that a timeout or an interrupt ends pytest with the Ray and gloo processes it started
        process = subprocess.Popen(command, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_session(process)
            return Outcome(rc=-1, failed=("(the run timed out)",), seconds=time.perf_counter() - started,
                           timed_out=True)
        except BaseException:
            end_session(process)
            raise
        seconds = time.perf_counter() - started
        returncode = process.returncode
        if returncode in (4, 5):  # usage error / nothing collected: the selection is wrong, not the mutant
            raise SystemExit(f"pytest could not run the selection {tests} (exit {returncode}):\n"
                             f"{stdout[-3000:]}\n{stderr[-3000:]}")
        failed = []
        if report.is_file():
            for case in ElementTree.parse(report).iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    failed.append(node_id(copy, case.get("classname", ""), case.get("name", "")))
        if returncode != 0 and not failed:
            failed.append(f"(pytest exit {returncode}: {stdout.strip().splitlines()[-1:]})")
    return Outcome(rc=returncode, failed=tuple(failed), seconds=seconds)


def end_session(process: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL, to the process group of ``process`` (pytest and what it started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def selected(test_id: str, selection: Sequence[str]) -> bool:
    """Whether ``test_id`` (``path::name[params]``) is one of ``selection`` (test files or node ids)."""
    for entry in selection:
        if "::" not in entry and test_id.split("::")[0] == entry:
            return True
        if test_id == entry or test_id.startswith(entry + "["):
            return True
    return False


def tier_caught(outcome: Outcome, tier: Sequence[str]) -> bool | None:
    """Whether a test of ``tier`` failed in ``outcome`` (None when the tier is empty)."""
    if not tier:
        return None
    return outcome.timed_out or any(selected(name, tier) for name in outcome.failed)


def node_id(copy: Path, classname: str, name: str) -> str:
    """pytest's node id of a JUnit test case (``classname`` is the dotted module path, then any class)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        module = "/".join(parts[:end]) + ".py"
        if (copy / module).is_file():
            return "::".join([module, *parts[end:], name])
    return f"{classname}::{name}"


class StaleSnippetError(Exception):
    """A mutant's snippet does not occur exactly once in its file: the code moved on."""


def apply(copy: Path, mutant: Mutant) -> str:
    """Write the mutant into the copy; return the file's original text."""
    path = copy / mutant.file
    original = path.read_text()
    count = original.count(mutant.old)
    if count != 1:
        raise StaleSnippetError(f"mutant {mutant.name}: its snippet occurs {count} times in {mutant.file} (expected "
                                f"once); the code has moved on, update the snippet in {Path(__file__).name}")
    path.write_text(original.replace(mutant.old, mutant.new))
    return original


TIER_CELL = {True: "yes", False: "no", None: "- (none selected)"}


def write_markdown(path: Path, *, results: list[dict[str, object]], source: str, baseline_s: float,
                   total_s: float, command: str, load: tuple[float, float]) -> None:
    caught = sum(1 for result in results if result.get("caught"))
    lines = [
        "# Mutation check: do the fast tests catch a broken learner?",
        "",
        "Written by `scripts/mutation_check.py` (do not edit by hand; issue #41). Each row is one known-bad change "
        "applied to a throw-away copy of the tree, and the tests of the default suite selected for it run against "
        "that copy: *caught* when one of them fails, *survived* (a hole in the suite) when all pass. The script is "
        "not part of `scripts/test.sh` (it runs the selected tests once per mutant); run it after changing the "
        "learner or its tests.",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {results_page.machine(with_load=False)}; load average (1 min) {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end (the box is shared: the seconds below grow with it)",
        f"- command: `{command}`",
        f"- tree: {source}",
        f"- baseline (every selected test, unmutated): passed in {baseline_s:.0f} s",
        f"- caught: {caught} of {len(results)}; whole run {total_s / 60:.1f} min",
        "",
        "Tiers: *component* tests run the changed code on hand-made inputs (loss terms, advantages, engine "
        "contracts, the handover); *learning* tests update a tiny model by RL through the FSDP engine or the trainer.",
        "",
        "| mutant | file | what it breaks | caught | by component tests | by learning tests | failing tests | "
        "tests run | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if "error" in result:
            lines.append(f"| `{result['name']}` | `{result['file']}` | {result['what']} | **not run**: its patch "
                         "no longer applies | | | | | |")
            continue
        failing = result["failed"]
        assert isinstance(failing, list)
        shown = "<br>".join(f"`{name}`" for name in failing[:6]) + (
            f"<br>(+{len(failing) - 6} more)" if len(failing) > 6 else "")
        tests = result["tests"]
        assert isinstance(tests, list)
        files = sorted({test.split("::")[0].removeprefix("tests/") for test in tests})
        lines.append(f"| `{result['name']}` | `{result['file']}` | {result['what']} | "
                     f"{'**caught**' if result['caught'] else '**survived**'} | "
                     f"{TIER_CELL[result['caught_by_component']]} | "  # type: ignore[index]
                     f"{TIER_CELL[result['caught_by_learning']]} | {shown or '-'} | "  # type: ignore[index]
                     f"{', '.join(f'`{name}`' for name in files)} | {result['seconds']:.0f} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
    parser.add_argument("--source", default="worktree", help="worktree (default) or git:REF")
    parser.add_argument("--write", type=Path, help="write the markdown table here (relative to the repo root)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run (results then assume it "
                        "passes)")
    parser.add_argument("--keep", action="store_true", help="keep the copy (its path is printed)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run (default 900)")
    parser.add_argument("--per-test-timeout", type=int, default=300, help="pytest-timeout per test (default 300)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill runs the cleanup below (copy, test processes)
    names = [name for name in args.only.split(",") if name]
    unknown = sorted(set(names) - {mutant.name for mutant in MUTANTS})
    if unknown:
        parser.error(f"unknown mutants {unknown}; known: {', '.join(mutant.name for mutant in MUTANTS)}")
    chosen = [mutant for mutant in MUTANTS if not names or mutant.name in names]
    if args.list:
        for mutant in chosen:
            print(f"{mutant.name}: {mutant.what}\n  file: {mutant.file}\n  tests: {' '.join(mutant.tests)}")
        return 0
    command = "OMP_NUM_THREADS=1 .venv/bin/python scripts/mutation_check.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    started, load_at_start = time.perf_counter(), os.getloadavg()[0]
    scratch = Path(tempfile.mkdtemp(prefix="hybridflow-mutants-"))
    try:
        copy = scratch / "tree"
        copy.mkdir()
        source = make_copy(args.source, copy)
        env = copy_environment(copy)
        check_imports_resolve_to(copy, env)
        print(f"copy of the {source} at {copy}", flush=True)
        selections = {mutant.name: existing(copy, mutant.tests) for mutant in chosen}
        union = list(dict.fromkeys(test for present, _ in selections.values() for test in present))
        baseline_s = 0.0
        if not args.no_baseline:
            baseline = run_tests(copy, env, union, timeout_s=args.timeout * 2, per_test_timeout_s=args.per_test_timeout)
            baseline_s = baseline.seconds
            record = {"tests": union, "failed": list(baseline.failed), "rc": baseline.rc,
                      "seconds": round(baseline.seconds, 1)}
            print(f"BASELINE {json.dumps(record)}", flush=True)
            if baseline.rc != 0:
                print("the unmutated copy fails the selected tests above: a mutant's result would mean nothing. Fix "
                      "them (or use --source git:REF of a tree that passes).", file=sys.stderr)
                return 2
        results: list[dict[str, object]] = []
        for mutant in chosen:
            present, missing = selections[mutant.name]
            try:
                original = apply(copy, mutant)
            except StaleSnippetError as error:  # reported, and the run goes on with the other mutants
                stale: dict[str, object] = {"name": mutant.name, "file": mutant.file, "what": mutant.what,
                                            "error": str(error)}
                results.append(stale)
                print(f"RESULT {json.dumps(stale)}", flush=True)
                continue
            try:
                outcome = run_tests(copy, env, present, timeout_s=args.timeout,
                                    per_test_timeout_s=args.per_test_timeout)
            finally:
                (copy / mutant.file).write_text(original)
            result: dict[str, object] = {
                "name": mutant.name, "file": mutant.file, "what": mutant.what, "tests": present,
                "caught": outcome.rc != 0, "failed": list(outcome.failed), "seconds": round(outcome.seconds, 1),
                # per tier (None: the tier has no test for this mutant); a timed-out run is counted for both
                "caught_by_component": tier_caught(outcome, mutant.component),
                "caught_by_learning": tier_caught(outcome, mutant.learning),
            }
            if missing:
                result["missing_tests"] = missing
            if outcome.timed_out:
                result["timed_out"] = True
            results.append(result)
            print(f"RESULT {json.dumps(result)}", flush=True)
        total_s = time.perf_counter() - started
        survived = [str(result["name"]) for result in results if result.get("caught") is False]
        stale_names = [str(result["name"]) for result in results if "error" in result]
        print(f"caught {len(results) - len(survived) - len(stale_names)} of {len(results)} in {total_s:.0f} s"
              f"{'; survived: ' + ', '.join(survived) if survived else ''}"
              f"{'; stale snippets (not run): ' + ', '.join(stale_names) if stale_names else ''}", flush=True)
        if args.write is not None:
            target = args.write if args.write.is_absolute() else ROOT / args.write
            write_markdown(target, results=results, source=source, baseline_s=baseline_s, total_s=total_s,
                           command=command, load=(load_at_start, os.getloadavg()[0]))
            print(f"wrote {target}")
        return 1 if stale_names else 0
    finally:
        if args.keep:
            print(f"kept the copy at {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
