"""TEST DOUBLE of ``sglang.srt.entrypoints.engine.Engine`` (sglang cannot run here: CUDA-only kernels).

``FakeSGLangEngine`` has the real Engine's method names and keyword names (test_sglang_api_drift.py checks them
against the released wheel) and mimics the behaviour the adapter relies on: prompt-major outputs for ``n`` samples,
``meta_info.output_token_logprobs`` as ``(logprob, token_id, None)``, stop on ``stop_token_ids`` (EOS included),
``sampling_seed`` reproducibility, weights that change outputs, memory tags, and a real broadcast receive over a
torch.distributed group. Its "model" is a hash of prompt, weights and seed, not a network.

For worker processes that a trainer starts, :func:`write_sglang_test_double_package` writes a package named
``sglang`` (TEST DOUBLE, on ``PYTHONPATH`` only for that run) whose modules re-export these doubles under the real
import paths, so the plugin's own ``load_sglang_backend`` binds them; with ``$HYBRIDFLOW_SGLANG_TEST_DOUBLE_LOG`` set
to a directory, every engine appends its calls there as JSON lines (one file per process).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow_sglang.api import SGLangBackend

VOCAB = 45
#: directory where engines log their calls (one ``engine-<pid>.jsonl`` per process) when set
LOG_ENV = "HYBRIDFLOW_SGLANG_TEST_DOUBLE_LOG"


@dataclass
class FakeLocalSerializedTensor:
    """TEST DOUBLE of sglang's ``LocalSerializedTensor``: one serialized payload per TP rank."""

    values: list[Any]


def fake_serialize(obj: Any) -> tuple[str, Any]:
    """TEST DOUBLE of ``MultiprocessingSerializer.serialize``: a tagged reference, no bytes."""
    return ("serialized", obj)


def stand_in_init_process_group(*, backend: str, init_method: str, world_size: int, rank: int,
                                group_name: str) -> Any:
    """Stand-in for sglang's ``init_custom_process_group``: the default gloo group of a fresh process."""
    from datetime import timedelta

    torch.distributed.init_process_group(backend="gloo", init_method=init_method, world_size=world_size, rank=rank,
                                         timeout=timedelta(seconds=90))
    return torch.distributed.group.WORLD


class _LoggedCalls(list[tuple[str, dict[str, Any]]]):
    """The engine's call list; each call is also appended to ``$HYBRIDFLOW_SGLANG_TEST_DOUBLE_LOG`` when set."""

    def append(self, call: tuple[str, dict[str, Any]]) -> None:
        super().append(call)
        self.log(*call)

    @staticmethod
    def log(name: str, info: dict[str, Any]) -> None:
        directory = os.environ.get(LOG_ENV)
        if directory:
            with open(Path(directory) / f"engine-{os.getpid()}.jsonl", "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"call": name, **info}, default=str) + "\n")


class FakeSGLangEngine:
    """TEST DOUBLE of ``sglang.Engine`` (signatures are a subset of the real ones; see the drift test)."""

    def __init__(self, **kwargs: Any) -> None:
        self.server_args = kwargs
        self.calls = _LoggedCalls()
        model_path = Path(str(kwargs.get("model_path")))
        self.calls.log("__init__", {"server_args": kwargs, "model_files": sorted(p.name for p in model_path.iterdir())
                                    if model_path.is_dir() else None})
        self.weights: dict[str, torch.Tensor] = {}
        self.direct_updates: list[list[tuple[str, Any]]] = []
        self.released: set[str] = set()
        self.last_outputs: list[dict[str, Any]] = []
        self.next_results: list[tuple[bool, str]] = []  # queued results for the next update calls
        self._group: Any = None
        self._rng = random.Random()

    # --- helpers ----------------------------------------------------------------------------------------------
    def _result(self) -> tuple[bool, str]:
        return self.next_results.pop(0) if self.next_results else (True, "Success")

    def _weight_offset(self) -> int:
        return int(sum(float(t.double().sum()) for t in self.weights.values()) * 1000) % VOCAB

    def _sample(self, prompt: list[int], params: dict[str, Any], sample: int) -> dict[str, Any]:
        greedy = params.get("temperature", 1.0) == 0 or params.get("top_k") == 1
        seed = params.get("sampling_seed")
        if greedy:
            noise = 0
        elif seed is not None and self.server_args.get("enable_deterministic_inference"):
            noise = seed % 9973
        else:
            noise = self._rng.randrange(9973)
        stops = set(params.get("stop_token_ids") or [])
        tokens: list[int] = []
        finish: dict[str, Any] = {"type": "length", "length": params["max_new_tokens"]}
        for step in range(params["max_new_tokens"]):
            token = (sum(prompt) * 31 + step * 7 + noise + self._weight_offset()) % VOCAB
            tokens.append(token)
            if token in stops:
                finish = {"type": "stop", "matched": token}
                break
        logprobs = [(-0.1 * (1 + (token + index) % 5), token, None) for index, token in enumerate(tokens)]
        return {"output_ids": list(tokens), "meta_info": {"finish_reason": finish, "output_token_logprobs": logprobs,
                                                          "id": f"req-{sample}"}}

    # --- the real Engine's methods ----------------------------------------------------------------------------
    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 return_logprob: Any = False, logprob_start_len: Any = None, stream: bool = False) -> Any:
        self.calls.append(("generate", {"input_ids": input_ids, "sampling_params": sampling_params,
                                        "return_logprob": return_logprob}))
        if prompt is not None and self.server_args.get("skip_tokenizer_init"):
            raise ValueError("skip_tokenizer_init=True needs input_ids, not text")
        if self.released & {"kv_cache", "weights"}:
            raise RuntimeError(f"generate while memory is released: {sorted(self.released)}")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(input_ids):
                raise ValueError("one sampling_params dict per request expected")
            if any(p.get("n", 1) != 1 for p in sampling_params):
                raise ValueError("Cannot use list sampling_params with parallel_sample_num > 1 in this test double")
            outputs = [self._sample(ids, params, 0) for ids, params in zip(input_ids, sampling_params)]
        else:
            n = sampling_params.get("n", 1)
            outputs = [self._sample(ids, sampling_params, j) for ids in input_ids for j in range(n)]
        if not return_logprob:
            for output in outputs:
                del output["meta_info"]["output_token_logprobs"]
        self.last_outputs = outputs
        return outputs

    def update_weights_from_tensor(self, named_tensors: Any, load_format: Any = None, flush_cache: bool = True) -> Any:
        self.calls.append(("update_weights_from_tensor", {"names": [n for n, _ in named_tensors],
                                                          "load_format": load_format, "flush_cache": flush_cache}))
        if "weights" in self.released:
            raise RuntimeError("update_weights_from_tensor while weights are released")
        result = self._result()
        if not result[0]:
            return result
        if load_format == "direct":
            self.direct_updates.append(list(named_tensors))
        else:
            for name, tensor in named_tensors:
                self.weights[name] = tensor.detach().clone()
        return result

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl") -> Any:
        self.calls.append(("init_weights_update_group", {"master_address": master_address, "master_port": master_port,
                                                         "rank_offset": rank_offset, "world_size": world_size,
                                                         "group_name": group_name, "backend": backend}))
        if backend == "gloo":  # a real receive for the gloo test; nccl is only recorded
            self._group = stand_in_init_process_group(
                backend=backend, init_method=f"tcp://{master_address}:{master_port}", world_size=world_size,
                rank=rank_offset, group_name=group_name)
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(self, names: Any, dtypes: Any, shapes: Any,
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        load_format: Any = None) -> Any:
        self.calls.append(("update_weights_from_distributed", {"names": list(names), "dtypes": list(dtypes),
                                                               "shapes": [list(s) for s in shapes],
                                                               "group_name": group_name, "flush_cache": flush_cache}))
        if self._group is not None:  # mirrors sglang's receive_weights_from_distributed
            received = []
            for name, dtype, shape in zip(names, dtypes, shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype))
                torch.distributed.broadcast(weight, src=0, group=self._group)
                received.append((name, weight))
            self.weights.update(received)
        return self._result()

    def destroy_weights_update_group(self, group_name: str) -> Any:
        self.calls.append(("destroy_weights_update_group", {"group_name": group_name}))
        return True, "Succeeded to destroy custom process group."

    def release_memory_occupation(self, tags: Any = None) -> Any:
        self.calls.append(("release_memory_occupation", {"tags": list(tags) if tags else None}))
        self.released |= set(tags or ["kv_cache", "weights", "cuda_graph"])

    def resume_memory_occupation(self, tags: Any = None) -> Any:
        self.calls.append(("resume_memory_occupation", {"tags": list(tags) if tags else None}))
        self.released -= set(tags or ["kv_cache", "weights", "cuda_graph"])

    def shutdown(self) -> None:
        self.calls.append(("shutdown", {}))


def build_fake_backend(created: list[FakeSGLangEngine] | None = None) -> SGLangBackend:
    """An :class:`SGLangBackend` wired to the test doubles; engines it builds are appended to ``created``."""
    created = created if created is not None else []

    def engine_class(**kwargs: Any) -> FakeSGLangEngine:
        engine = FakeSGLangEngine(**kwargs)
        created.append(engine)
        return engine

    return SGLangBackend(engine_class=engine_class, serialize=fake_serialize,
                         local_serialized_tensor=lambda values: FakeLocalSerializedTensor(values=values),
                         init_custom_process_group=stand_in_init_process_group)



#: modules of the ``sglang`` TEST DOUBLE package → their source (re-exports of the doubles above)
_PACKAGE = {
    "sglang/__init__.py": '"""TEST DOUBLE of the sglang package (tests/plugins/sglang/sglang_test_double.py)."""\n',
    "sglang/srt/__init__.py": "",
    "sglang/srt/entrypoints/__init__.py": "",
    "sglang/srt/entrypoints/engine.py": "from sglang_test_double import FakeSGLangEngine as Engine  # TEST DOUBLE\n",
    "sglang/srt/model_executor/__init__.py": "",
    "sglang/srt/model_executor/model_runner_components/__init__.py": "",
    "sglang/srt/model_executor/model_runner_components/weight_updater.py":
        "from sglang_test_double import FakeLocalSerializedTensor as LocalSerializedTensor  # TEST DOUBLE\n",
    "sglang/srt/utils/__init__.py": "",
    "sglang/srt/utils/common.py": (
        "from sglang_test_double import fake_serialize, stand_in_init_process_group  # TEST DOUBLE\n\n\n"
        "class MultiprocessingSerializer:\n"
        "    serialize = staticmethod(fake_serialize)\n\n\n"
        "init_custom_process_group = stand_in_init_process_group\n"
    ),
}


def write_sglang_test_double_package(site: Path) -> Path:
    """Write the ``sglang`` TEST DOUBLE package into ``site`` (put ``site`` and this file's folder on PYTHONPATH)."""
    for relative, source in _PACKAGE.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return site
