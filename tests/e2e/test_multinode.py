"""Multi-node on Ray, for real on one box: a two-node Ray cluster on loopback (``ray start --head`` and
``ray start --address`` for a second raylet, token authentication on), started once for the module, that
``hybridflow train`` joins by ``ray.address``; a worker group of ``devices_per_node: [2, 2]`` placed on it (four
ranks forming one gloo group) and runs with ``[1, 1]`` (a run whose second node is killed mid-run, and the same run
without the kill with both ranks on one node).

What it shows: a driver without the cluster's token is refused with a config error saying how to join; the run
joins the named cluster (its manifest records the head's GCS address, its workers report the cluster's node ids);
the ranks of each ``devices_per_node`` entry sit on one node and the entries on distinct nodes (each worker reports
its own Ray node id), a torch.distributed rendezvous spanning both nodes (a gloo all-reduce over four ranks, and
FSDP's gloo group training), and the node death detected (the rank on it dies) and recovered by the existing replay
on a spare node that joined: the node's placement group is re-reserved on the spare (never on the surviving one),
the run finishes, and its final weights are bit-identical to the uninjected one-node run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.export import export_run
from hybridflow.testing.ray_cluster import BIN, FAST_FAILURE_DETECTION, LoopbackCluster, kill_process_group, start_head

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo_arithmetic_scratch.yaml"
STEPS = 4


@pytest.fixture(scope="session", autouse=True)
def _ray_session() -> None:
    """No Ray in this process (it overrides the e2e conftest's local one): the runs are ``hybridflow train``
    processes joining the cluster, and the cluster is read by short-lived drivers."""


@pytest.fixture(scope="module")
def head() -> Iterator[LoopbackCluster]:
    """A Ray head (2 CPUs, resource ``node_a``), killed after the module; the one cluster all its tests use."""
    try:
        cluster = start_head(num_cpus=2, resources={"node_a": 1}, extra_env=FAST_FAILURE_DETECTION)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def two_nodes(head: LoopbackCluster) -> LoopbackCluster:
    """The head plus a second raylet (2 CPUs, ``node_b``). Shared by the module's tests; the node-kill test, which
    replaces ``node_b``, runs last."""
    try:
        head.add_node(num_cpus=2, resources={"node_b": 1})
    except RuntimeError as first:  # Ray's own join (seen once inside the full suite): one retry, then say so
        try:
            head.add_node(num_cpus=2, resources={"node_b": 1})
        except RuntimeError as second:
            pytest.skip(f"Ray could not form a two-node loopback cluster on this box (a second raylet did not "
                        f"register with the head, twice); nothing of hybridflow ran yet: {first} / {second}")
    return head


def _train(cluster: LoopbackCluster, run_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    """``hybridflow train`` of the example joining ``cluster``, in its own session, logging to ``run_dir``.log."""
    command = [str(BIN / "hybridflow"), "train", str(EXAMPLE), f"ray.address={cluster.address}",
               f"trainer.run_dir={run_dir}", "trainer.tensorboard=false", "trainer.resume=never",
               "trainer.deadline_s=120", "trainer.val_every=0", *overrides, "--no-progress"]
    with run_dir.with_suffix(".log").open("w") as log:
        return subprocess.Popen(command, env=cluster.driver_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
                                cwd=REPO, start_new_session=True)


def _finish(process: subprocess.Popen[str], run_dir: Path, steps: int, timeout_s: float = 300) -> None:
    """Wait for the run; it must exit 0 having done ``steps`` steps (killed, with its log, otherwise)."""
    try:
        rc = process.wait(timeout=timeout_s)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    output = run_dir.with_suffix(".log").read_text(errors="replace")
    assert rc == 0, output[-5000:]
    assert f"done: {steps} steps" in output, output[-3000:]


def _wait_for(path: Path, process: subprocess.Popen[str], timeout_s: float) -> None:
    """Until ``path`` exists; the run (``path``'s grandparent) must not exit before, nor take over ``timeout_s``."""
    deadline = time.time() + timeout_s
    while not path.exists():
        if process.poll() is None and time.time() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        if process.poll() is not None:
            log = path.parents[1].with_suffix(".log").read_text(errors="replace")
            pytest.fail(f"{path} never appeared (run exited {process.returncode}):\n{log[-5000:]}")
        time.sleep(0.5)


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_joining_without_the_token_is_a_config_error_that_says_how(head: LoopbackCluster) -> None:
    # the driver runs hybridflow.controller's init_ray without the package's __init__ (its worker-group modules pull
    # in torch: ~8 CPU-seconds a process, nothing this refusal touches); security first, before Ray, as the package
    # itself imports them
    code = ("import sys, types\nfrom pathlib import Path\nimport hybridflow\n"
            "package = types.ModuleType('hybridflow.controller')\n"
            "package.__path__ = [str(Path(hybridflow.__file__).parent / 'controller')]\n"
            "sys.modules['hybridflow.controller'] = package\n"
            "import hybridflow.controller.security\nfrom hybridflow.controller.runtime import init_ray\n"
            f"init_ray({head.address!r})\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_NUM_REDIS_GET_RETRIES"] = "2"  # Ray's GCS connect retries (~1 s each, 20 by default) before it gives up
    result = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "ConfigError" in result.stderr and "RAY_AUTH_MODE=token" in result.stderr, result.stderr[-3000:]


#: a driver joining the cluster (argv[1]) that places a ``devices_per_node=[2, 2]`` group (what a pool of that config
#: becomes in the trainer) and has its four ranks all-reduce over one gloo group; prints the sums and the placement
#: the workers reported from inside (the manifest's ``placement`` section)
PLACE_AND_ALL_REDUCE = """
import json, sys
from datetime import timedelta
from hybridflow.controller import ResourcePool, Worker, WorkerGroup, init_ray, register

class Ranks(Worker):
    @register(protocol="one_to_all", deadline_s=120)
    def all_reduce(self) -> float:
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        tensor = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(tensor)
        return float(tensor.item())

init_ray(sys.argv[1])
pool = ResourcePool("main", devices_per_node=[2, 2], device="cpu", cpus_per_worker=0.5)
group = WorkerGroup(pool, {"ranks": Ranks}, name="main", deadline_s=120)
print("RESULT=" + json.dumps({"sums": group.ranks.all_reduce(), "placement": group.placement()}))
group.shutdown()
pool.release()
"""


@pytest.mark.slow  # 45-70 s in the full run of 2026-12-07 (tests/durations.json)
@pytest.mark.timeout(400)
def test_two_ranks_per_node_sit_on_their_node_and_reduce_together(two_nodes: LoopbackCluster) -> None:
    nodes = {two_nodes.head.node_id, two_nodes.workers[0].node_id}
    result = subprocess.run([sys.executable, "-c", PLACE_AND_ALL_REDUCE, two_nodes.address], env=two_nodes.driver_env(),
                            capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    found = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT="))[7:])
    placement = found["placement"]
    ranks = placement["ranks"]
    assert [(p["rank"], p["node_index"], p["local_rank"]) for p in ranks] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)], ranks
    # as each worker saw it from inside: both ranks of an entry on one node, the two entries on the two nodes
    node_of_entry = [{p["node_id"] for p in ranks if p["node_index"] == index} for index in (0, 1)]
    assert all(len(ids) == 1 for ids in node_of_entry), ranks
    assert node_of_entry[0] | node_of_entry[1] == nodes, (ranks, nodes)
    assert placement["local_ray"] is False
    # the four ranks' gloo group spans both nodes: every rank got 1 + 2 + 3 + 4
    assert found["sums"] == [10.0] * 4, found


@pytest.mark.slow  # 91 s on a quiet 2-core box: an uninjected 4-step run on one node, then the two-node run
# with a node death
@pytest.mark.timeout(900)
def test_one_rank_per_node_and_a_dead_node_is_recovered_to_the_uninjected_weights(
        tmp_path: Path, two_nodes: LoopbackCluster) -> None:
    node_a, node_b = two_nodes.head, two_nodes.workers[0]
    nodes = {"node_a": node_a.node_id, "node_b": node_b.node_id}
    addresses = {node.node_id: node.address for node in (node_a, node_b)}
    assert nodes["node_a"] != nodes["node_b"]
    common = (f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=2")
    # the reference: the same config and seed without the fault, its two ranks on ONE node of the same cluster
    # (devices_per_node=[2]: one placement group, packed). Same world size, ranks and seeds, so equal weights show
    # both that the replay reproduced the run and that spreading the ranks over two nodes changed nothing.
    clean_dir = tmp_path / "clean"
    _finish(_train(two_nodes, clean_dir, "resource_pools.main.devices_per_node=[2]", *common), clean_dir, STEPS)
    clean_manifest = json.loads((clean_dir / "manifest.json").read_text())
    # `hybridflow train` joined the cluster named by ray.address (its head's GCS, not a local Ray of its own): the
    # manifest says so and both ranks report one of the cluster's nodes
    assert clean_manifest["ray"]["address"] == clean_manifest["ray"]["gcs_address"] == two_nodes.address
    clean_ranks = clean_manifest["placement"]["main"]["ranks"]
    assert len({p["node_id"] for p in clean_ranks}) == 1 and clean_ranks[0]["node_id"] in nodes.values(), clean_ranks

    # both ranks hang inside their update of iteration 3 (a deterministic moment mid-run, after the optimizer step,
    # and the rank left alive stays busy, as a peer blocked in a collective would); the test then kills the second
    # node's raylet
    run_dir = tmp_path / "run"
    process = _train(two_nodes, run_dir, "resource_pools.main.devices_per_node=[1,1]", *common,
                     'reliability.faults=["actor.update@3:hang:rank=0","actor.update@3:hang:rank=1"]')
    for rank in (0, 1):
        _wait_for(run_dir / "faults" / f"actor.update@3.hang.rank{rank}.fired", process, timeout_s=300)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    # a spare machine joins first (started after the kill, on a loaded box its raylet came up later than the 60 s
    # the restart waits for a node), then the second machine dies: raylet, store, workers
    replacement = two_nodes.add_node(num_cpus=2, resources={"node_c": 1})
    new_b = replacement.node_id
    kill_process_group(node_b.process)
    _finish(process, run_dir, STEPS)
    assert replacement.process.poll() is None

    # one rank per node, as each worker saw it from inside; the rendezvous spanned both (the run trained)
    placement = manifest["placement"]["main"]["ranks"]
    assert [(p["rank"], p["node_index"]) for p in placement] == [(0, 0), (1, 1)], placement
    node_of = {p["rank"]: p["node_id"] for p in placement}
    assert sorted(node_of.values()) == sorted(nodes.values()), (placement, nodes)
    # the joined-cluster path: the rendezvous is rank 0's node address as registered with Ray (`ray start` turns
    # --node-ip-address 127.0.0.1 into this machine's reachable address once multi-node is on), not 127.0.0.1
    assert manifest["placement"]["main"]["local_ray"] is False
    host, _port = manifest["placement"]["main"]["rendezvous"].rsplit(":", 1)
    assert host == addresses[node_of[0]], (manifest["placement"], addresses)
    on_b = next(rank for rank, node in node_of.items() if node == nodes["node_b"])
    assert manifest["ray"]["address"] == two_nodes.address

    # the node's death was detected as a dead worker and recovered: group restarted, checkpoint of step 2 restored,
    # iteration 2's update replayed, iteration 3 retried
    events = [json.loads(line) for line in (run_dir / "recovery.jsonl").read_text().splitlines()]
    assert len(events) == 1, events
    event = events[0]
    assert event["pools_restarted"] == ["main"] and event["what"] == "iteration 3", event
    assert event["error"] == "WorkerError" and "died" in event["message"], event  # not the 120 s deadline
    assert event["seconds_failed_attempt"] < 60, event
    assert event["checkpoint"] and event["checkpoint"].endswith("step-2"), event
    assert event["updates_replayed"] == ["actor.update_policy@2"], event  # iteration 2's update, from the driver
    # the rank of the dead node came back on the replacement node, the other rank stayed on the head
    assert {p["rank"]: p["node_id"] for p in event["placement"]["main"]["ranks"]} == {**node_of, on_b: new_b}, event

    # the replay reproduced the uninjected run: the same samples scored the same each step, and the final weights
    # (the last checkpoint, exported offline) are bit-identical
    clean, faulty = _metrics(clean_dir), _metrics(run_dir)
    assert [m["step"] for m in faulty] == list(range(STEPS)), faulty
    assert [m["reward/mean"] for m in faulty] == [m["reward/mean"] for m in clean], (clean, faulty)
    weights = {name: load_file(export_run(path, tmp_path / f"w_{name}") / "model.safetensors")
               for name, path in (("clean", clean_dir), ("faulty", run_dir))}
    assert weights["clean"].keys() == weights["faulty"].keys()
    differing = [k for k in weights["clean"] if not torch.equal(weights["clean"][k], weights["faulty"][k])]
    assert differing == [], differing
    assert [m["actor/policy_version"] for m in faulty] == [1.0, 2.0, 3.0, 4.0], faulty  # one update per step
