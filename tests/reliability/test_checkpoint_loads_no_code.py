"""Checkpoints load no code: for each engine (fsdp, deepspeed ZeRO-2 and ZeRO-3, megatron) a real checkpoint saved
the way the trainer saves one, then a payload (unpickling it runs ``touch MARKER``) planted into each pickle-bearing
file of it in turn, ``checksums.json`` rewritten to match. Resuming (the trainer's checksum check, then the engine's
``load_checkpoint``) and ``hybridflow export`` must refuse the file with an ``UnsafeCheckpointError`` naming it and
the payload's global, and the marker must not exist; a file export does not read must leave export working. Each case
first shows the planted file does run the payload when read the way torch's or DeepSpeed's own loader reads it.
Then the loaders alone: a payload pickled with protocol 5 or in torch's legacy format, a damaged file (unreadable, not
unsafe), a ``.metadata`` that would change a class or names a data file outside its directory."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.errors import CheckpointError, UnsafeCheckpointError
from hybridflow.export import export_run
from reliability.planted import (
    PAYLOAD_GLOBAL,
    ROLE,
    Payload,
    build_actor,
    distcp_item,
    plant_in_distcp,
    plant_in_metadata,
    plant_in_torch_file,
    reseal,
    resume,
    run_config,
    train_and_save,
)

HERE = Path(__file__).resolve().parent
#: the example's critic and reference sections, which GRPO does not build, are warned about by every planning
pytestmark = pytest.mark.filterwarnings("ignore:.*builds no (critic|reference) role in this run:UserWarning")


@pytest.fixture(scope="module", autouse=True)
def _ray_session() -> None:
    """No Ray here: the engines run in this process (megatron's in one of its own); overrides conftest.py's."""


def _tampered(step_dir: Path, tmp_path: Path, plant: Callable[[Path, Path], Path]) -> tuple[Path, Path, Path]:
    """A copy of the run of ``step_dir`` whose role directory ``plant(directory, marker)`` tampered with (returning
    the file it planted into), the checksums rewritten; returns (copied step directory, that file, the marker)."""
    run = tmp_path / "run"
    shutil.copytree(step_dir.parents[1], run)
    copy, marker = run / "checkpoints" / step_dir.name, tmp_path / "code-ran"
    file = plant(copy / ROLE, marker)
    reseal(copy)
    return copy, file, marker


def _into(relative: str, plant: Callable[[Path, Path], None]) -> Callable[[Path, Path], Path]:
    """``plant(file, marker)`` applied to ``relative`` in the role directory."""

    def apply(directory: Path, marker: Path) -> Path:
        plant(directory / relative, marker)
        return directory / relative

    return apply


def _runs_code(read: Callable[[], Any], marker: Path) -> None:
    """The planted file is live: reading it as torch's or DeepSpeed's own loader does runs the payload."""
    with contextlib.suppress(Exception):  # only whether the payload ran matters (what follows it may not parse)
        read()
    assert marker.exists(), "the planted payload did not run under a plain unpickler: the test would prove nothing"
    marker.unlink()


def _refused(call: Callable[[], Any], file: Path, marker: Path) -> None:
    with pytest.raises(UnsafeCheckpointError) as caught:
        call()
    assert not marker.exists(), f"loading {file} ran the code planted in it"
    assert caught.value.path == str(file) and PAYLOAD_GLOBAL in caught.value.found, caught.value
    assert str(file) in str(caught.value) and "Fix:" in str(caught.value)


def _check_export(run: Path, tmp_path: Path, file: Path, marker: Path, *, reads: bool) -> None:
    export = lambda: export_run(run, tmp_path / "hf")  # noqa: E731
    if reads:
        _refused(export, file, marker)
    else:  # this file holds no weights: export does not open it, and works
        assert (export() / "model.safetensors").exists()
    assert not marker.exists()


# --- fsdp: .metadata, a .distcp tensor and non-tensor value, the engine state --------------------------------------

@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    config = run_config(tmp_path_factory.mktemp("fsdp") / "run", "fsdp")
    engine = build_actor(config)
    return engine, train_and_save(config, engine)


def test_a_clean_fsdp_checkpoint_resumes_and_exports(fsdp_run: tuple[Any, Path], tmp_path: Path) -> None:
    engine, step_dir = fsdp_run
    resume(engine, step_dir)
    assert (export_run(step_dir.parents[1], tmp_path / "hf") / "model.safetensors").exists()


def _torch_load(file: Path) -> Callable[[], Any]:
    return lambda: torch.load(file, map_location="cpu", weights_only=False)


@pytest.mark.parametrize(("relative", "export_reads"), [("engine_state_rank0.pt", False), (".metadata", True)])
def test_fsdp_pickled_files_are_refused(fsdp_run: tuple[Any, Path], tmp_path: Path, relative: str,
                                        export_reads: bool) -> None:
    engine, step_dir = fsdp_run
    metadata = relative == ".metadata"
    copy, file, marker = _tampered(step_dir, tmp_path,
                                   _into(relative, plant_in_metadata if metadata else plant_in_torch_file))
    if metadata:  # torch's own FileSystemReader unpickles it with pickle.load
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        _runs_code(lambda: FileSystemReader(str(file.parent)).read_metadata(), marker)
    else:
        _runs_code(_torch_load(file), marker)
    _refused(lambda: resume(engine, copy), file, marker)
    _check_export(copy.parents[1], tmp_path, file, marker, reads=export_reads)


@pytest.mark.parametrize(("fqn_prefix", "tensor"), [("optimizer.param_groups", False), ("model.", True)],
                         ids=["value", "tensor"])
def test_fsdp_distcp_items_are_refused(fsdp_run: tuple[Any, Path], tmp_path: Path, fqn_prefix: str,
                                       tensor: bool) -> None:
    """A non-tensor value (read by torch's DefaultLoadPlanner with weights_only=False) and a model tensor."""
    engine, step_dir = fsdp_run
    copy, file, marker = _tampered(step_dir, tmp_path, lambda directory, marker: plant_in_distcp(
        directory, marker, fqn_prefix=fqn_prefix, tensor=tensor))
    item = distcp_item(file, fqn_prefix=fqn_prefix, tensor=tensor)
    _runs_code(lambda: torch.load(io.BytesIO(item), weights_only=False), marker)  # as DefaultLoadPlanner reads values
    _refused(lambda: resume(engine, copy), file, marker)
    _check_export(copy.parents[1], tmp_path, file, marker, reads=tensor)  # export reads the model's tensors only


# --- deepspeed: the engine state, module states, optimizer partitions (ZeRO-2 and ZeRO-3 lay them out apart) -------

DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                               reason="deepspeed is not installed (bash scripts/setup.sh --all)")
#: stage → (file, whether export reads it)
DEEPSPEED_FILES = {
    3: [("engine_state_rank0.pt", True), ("deepspeed/zero_pp_rank_0_mp_rank_00_model_states.pt", True),
        ("deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt", True)],
    2: [("engine_state_rank0.pt", True), ("deepspeed/mp_rank_00_model_states.pt", True),
        ("deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt", False)],
}


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Any, Path]]:
    runs = {}
    for stage in DEEPSPEED_FILES:
        config = run_config(tmp_path_factory.mktemp(f"zero{stage}") / "run", "deepspeed",
                            f"actor.extra.zero_stage={stage}")
        engine = build_actor(config)
        runs[stage] = engine, train_and_save(config, engine)
    return runs


@DEEPSPEED
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", sorted(DEEPSPEED_FILES))
def test_deepspeed_checkpoint_files_are_refused(deepspeed_runs: dict[int, tuple[Any, Path]], tmp_path: Path,
                                                stage: int) -> None:
    engine, step_dir = deepspeed_runs[stage]
    saved = sorted(str(p.relative_to(step_dir / ROLE)) for p in (step_dir / ROLE).rglob("*.pt"))
    assert saved == sorted(name for name, _ in DEEPSPEED_FILES[stage]), saved  # every pickle-bearing file covered
    resume(engine, step_dir)  # the clean checkpoint loads through the allow-list
    assert (export_run(step_dir.parents[1], tmp_path / "clean") / "model.safetensors").exists()
    for number, (relative, export_reads) in enumerate(DEEPSPEED_FILES[stage]):
        case = tmp_path / str(number)
        copy, file, marker = _tampered(step_dir, case, _into(relative, plant_in_torch_file))
        _runs_code(_torch_load(file), marker)  # as DeepSpeed's TorchCheckpointEngine.load reads it
        _refused(lambda copy=copy: resume(engine, copy), file, marker)
        _check_export(copy.parents[1], case, file, marker, reads=export_reads)


# --- megatron: the per-rank file (layout.json is JSON) ---------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ask(process: subprocess.Popen[str], request: str) -> dict[str, Any]:
    """Send ``request`` to megatron_resume.py; its ``RESULT`` answer."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(request + "\n")
    process.stdin.flush()
    for line in process.stdout:
        if line.startswith("RESULT "):
            answer: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            return answer
    pytest.fail(f"megatron_resume.py exited ({process.wait()}) without answering {request}")


@pytest.mark.megatron
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core not installed (bash scripts/install_megatron.sh .venv)")
def test_megatron_rank_file_is_refused(tmp_path: Path) -> None:
    from hybridflow.manifest import build_manifest, write_manifest

    run_dir = tmp_path / "saved" / "run"
    config = run_config(run_dir, "megatron")
    write_manifest(run_dir, build_manifest(config, protocols={}, mapping={ROLE: {"engine": "megatron"}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    with (tmp_path / "megatron.log").open("w") as log:
        process = subprocess.Popen([sys.executable, str(HERE / "megatron_resume.py"), str(run_dir)], env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert process.stdout is not None
            for line in process.stdout:
                if line.strip() == "saved":
                    break
            else:
                pytest.fail(f"megatron_resume.py exited ({process.wait()}):\n"
                            f"{(tmp_path / 'megatron.log').read_text()[-3000:]}")
            step_dir = run_dir / "checkpoints" / "step-1"
            assert sorted(p.name for p in (step_dir / ROLE).iterdir()) == [
                "layout.json", "rank_00000.pt", "worker_state.json"]
            assert _ask(process, str(step_dir)) == {"error": None}  # the clean checkpoint resumes
            assert (export_run(run_dir, tmp_path / "clean") / "model.safetensors").exists()
            copy, file, marker = _tampered(step_dir, tmp_path, _into("rank_00000.pt", plant_in_torch_file))
            _runs_code(_torch_load(file), marker)
            answer = _ask(process, str(copy))
            assert not marker.exists(), f"resuming from {file} ran the code planted in it"
            assert answer["error"] == "UnsafeCheckpointError" and answer["path"] == str(file), answer
            assert PAYLOAD_GLOBAL in answer["found"] and str(file) in answer["message"], answer
            _check_export(copy.parents[1], tmp_path, file, marker, reads=True)
            process.stdin.write("quit\n")  # type: ignore[union-attr]  # a pipe, opened above
            process.stdin.flush()  # type: ignore[union-attr]
            assert process.wait(timeout=60) == 0
        finally:
            if process.poll() is None:
                process.kill()


# --- the loaders themselves ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("writer", ["torch.save", "torch.save legacy", "pickle protocol 5"])
def test_a_payload_is_named_whatever_pickled_it(tmp_path: Path, writer: str) -> None:
    """torch names a refused global only for protocol-2 pickles (what torch.save writes); for a protocol-4/5 one it
    reports an "unsupported operand", and the global is found by reading the opcodes."""
    from hybridflow.checkpoint_files.safe_load import load_torch_file

    file, marker = tmp_path / "engine_state_rank0.pt", tmp_path / "code-ran"
    state = {"version": 3, "planted": Payload(marker)}
    if writer == "pickle protocol 5":
        file.write_bytes(pickle.dumps(state, protocol=5))
    else:
        torch.save(state, file, _use_new_zipfile_serialization=writer == "torch.save")
    _runs_code(_torch_load(file), marker)
    _refused(lambda: load_torch_file(file), file, marker)


def test_a_damaged_file_is_unreadable_not_unsafe(tmp_path: Path) -> None:
    from hybridflow.checkpoint_files.safe_load import load_torch_file

    file = tmp_path / "engine_state_rank0.pt"
    torch.save({"weights": torch.zeros(64)}, file)
    file.write_bytes(file.read_bytes()[:200])  # cut short, as an interrupted copy leaves it
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {file} could not be read")) as caught:
        load_torch_file(file)
    assert not isinstance(caught.value, UnsafeCheckpointError)


def test_the_metadata_unpickler_never_changes_a_class(tmp_path: Path) -> None:
    """BUILD on a class object listed in the allow-list (``Metadata`` itself, not an instance) would set its
    attributes for the whole process under a plain unpickler; here it is refused and the class is unchanged."""
    from torch.distributed.checkpoint.metadata import Metadata

    from hybridflow.checkpoint_files.safe_dcp import read_metadata

    def text(value: str) -> bytes:
        return pickle.BINUNICODE + len(value).to_bytes(4, "little") + value.encode()

    file = tmp_path / ".metadata"  # Metadata, then BUILD with state (None, {"version": "altered"}): setattr on it
    file.write_bytes(pickle.PROTO + b"\x02" + pickle.GLOBAL + b"torch.distributed.checkpoint.metadata\nMetadata\n" +
                     pickle.NONE + pickle.EMPTY_DICT + text("version") + text("altered") + pickle.SETITEM +
                     pickle.TUPLE2 + pickle.BUILD + pickle.STOP)
    before = Metadata.__dict__.get("version")
    with pytest.raises(UnsafeCheckpointError, match="setting the state of <class 'type'>"):
        read_metadata(file)
    assert Metadata.__dict__.get("version") == before


def test_metadata_naming_a_file_outside_its_directory_is_refused(fsdp_run: tuple[Any, Path], tmp_path: Path) -> None:
    engine, step_dir = fsdp_run

    def escape(directory: Path, marker: Path) -> Path:
        with (directory / ".metadata").open("rb") as handle:
            metadata = pickle.load(handle)  # the test's own file, just written
        next(iter(metadata.storage_data.values())).relative_path = "../../../../outside.distcp"
        with (directory / ".metadata").open("wb") as handle:
            pickle.dump(metadata, handle)
        return directory / ".metadata"

    copy, file, _ = _tampered(step_dir, tmp_path, escape)
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {file} names data file "
                                                        "'../../../../outside.distcp', which is not a file of its")):
        resume(engine, copy)
