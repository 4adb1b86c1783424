"""The CUDA paths that run without Ray, checked on one GPU: FSDP2 on NCCL with bf16 mixed precision against an fp32
reference step, the fsdp contract suite on CUDA, the lean forward against HF on CUDA, megatron-core on CUDA without
the CPU shim (logits equal HF, the training-engine contract suite), and peak CUDA memory of each.

It needs torch with CUDA plus hybridflow's own dependencies (transformers, safetensors, pydantic, pluggy; megatron-core
for the megatron part); what it cannot import is skipped with the reason. Ray, vLLM and SGLang are not used. Run it
through ``scripts/gpu_check.sh OUT_DIR`` (see docs/guide/gpu.md); ``--allow-cpu`` runs the same code on the CPU (gloo),
a dry run that proves the script itself works on a box without a GPU.

Writes ``OUT_DIR/gpu_check.json`` and ``OUT_DIR/gpu_check.md``; exits 1 if a check failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: model of the FSDP and lean-forward checks: big enough that bf16 rounding shows, small enough to take seconds
WIDE: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_layers": 4, "num_heads": 4,
                        "num_kv_heads": 2}


class Skip(Exception):
    """A check that cannot run here (no CUDA, a module missing); the message says what to do."""


#: what hybridflow's core and the fsdp plugin import besides torch
BASE_MODULES = ("transformers", "safetensors", "pydantic", "pluggy", "yaml")


def require(*modules: str) -> None:
    missing = [name for name in (*BASE_MODULES, *modules) if importlib.util.find_spec(name) is None]
    if missing:
        raise Skip(f"modules not importable: {', '.join(missing)}. Bring them as wheels (scripts/gpu_check.sh "
                   f"--make-wheelhouse DIR on a machine with internet, then --wheelhouse DIR here)")


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> int | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def expect(condition: bool, message: str, failures: list[str]) -> None:
    if not condition:
        failures.append(message)


# --- FSDP2 -------------------------------------------------------------------------------------------------------
def check_fsdp2_bf16_vs_fp32(device: str) -> dict[str, Any]:
    """One FSDP2 rank on NCCL: a bf16 mixed-precision engine and an fp32 one take 3 steps on the same batch; their
    log-probs, losses and weight updates agree to bf16 precision; the optimizer state lives on the device."""
    require("hybridflow_fsdp")
    import torch.distributed as dist

    from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngineConfig
    from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll
    from hybridflow.testing.fixtures import tiny_model_config
    from hybridflow_fsdp.training import FSDPTrainingEngine

    spec = ModelSpec(config=tiny_model_config(**WIDE), seed=0)
    batch = build_training_batch(rows=16, prompt_length=12, response_length=12)
    optim = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0)
    out: dict[str, Any] = {}
    runs: dict[str, dict[str, Any]] = {}
    for precision in ("none", "bf16"):
        reset_peak(device)
        engine = FSDPTrainingEngine(role="actor", device=device, config=TrainingEngineConfig(
            model=spec, optim=optim, micro_batch_size=8, mixed_precision=precision, extra={"fsdp_always": True}))
        initial = {name: tensor.detach().float().clone() for name, tensor in engine.generation_weights()}
        params = sum(t.numel() for t in initial.values())
        before = engine.compute_log_probs(batch)["log_probs"].float().cpu()
        losses = [engine.train_step(batch, loss_fn=sequence_mean_nll)["loss"] for _ in range(3)]
        after = engine.compute_log_probs(batch)["log_probs"].float().cpu()
        delta = torch.cat([(tensor.detach().float() - initial[name]).flatten().cpu()
                           for name, tensor in engine.generation_weights()])
        runs[precision] = {"before": before, "after": after, "losses": losses, "delta": delta,
                           "peak": peak_bytes(device), "params": params, "sharded": engine.sharded,
                           "param_dtype": str(next(engine.model.parameters()).dtype)}
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    fp32, bf16 = runs["none"], runs["bf16"]
    mask = batch["response_mask"].bool()
    cosine = float(torch.nn.functional.cosine_similarity(fp32["delta"], bf16["delta"], dim=0))
    out.update(
        backend=dist.get_backend() if dist.is_initialized() else None,
        params=fp32["params"],
        log_prob_gap_before=float((fp32["before"] - bf16["before"]).abs()[mask].max()),
        losses_fp32=fp32["losses"], losses_bf16=bf16["losses"],
        update_cosine=cosine,
        update_norm_ratio=float(bf16["delta"].norm() / fp32["delta"].norm()),
        peak_bytes_fp32=fp32["peak"], peak_bytes_bf16=bf16["peak"],
        fsdp_wrapped=[fp32["sharded"], bf16["sharded"]],
    )
    failures: list[str] = []
    expect(device != "cuda" or out["backend"] == "nccl", f"backend {out['backend']}, expected nccl", failures)
    expect(all(out["fsdp_wrapped"]), "an engine was not FSDP-wrapped (extra.fsdp_always)", failures)
    expect(out["log_prob_gap_before"] < 5e-2, f"bf16 log-probs differ from fp32 by {out['log_prob_gap_before']}",
           failures)
    for name in ("losses_fp32", "losses_bf16"):
        expect(out[name][-1] < out[name][0], f"{name} did not fall: {out[name]}", failures)
    gaps = [abs(a - b) / abs(a) for a, b in zip(fp32["losses"], bf16["losses"])]
    expect(max(gaps) < 2e-2, f"bf16 losses differ from fp32 by up to {max(gaps):.3%}", failures)
    expect(cosine > 0.95, f"bf16 and fp32 weight updates point apart (cosine {cosine:.4f})", failures)
    if device == "cuda":
        # fp32 weights + grads + two Adam moments stay on the GPU: at least 16 bytes per parameter
        expect(fp32["peak"] >= 16 * fp32["params"], f"peak {fp32['peak']} B < 16 B × {fp32['params']} parameters: "
               "the optimizer state is not on the GPU", failures)
    out["failures"] = failures
    return out


def check_fsdp_contracts(device: str) -> dict[str, Any]:
    """The shared training-engine contract suite against the FSDP engine on ``device``."""
    require("hybridflow_fsdp")
    from hybridflow.testing.contracts import TRAINING_CHECKS
    from hybridflow_fsdp.training import FSDPTrainingEngine

    passed, failures = [], []
    with tempfile.TemporaryDirectory() as workdir:
        for check in TRAINING_CHECKS:
            try:
                check(lambda role, config: FSDPTrainingEngine(role=role, config=config, device=device), Path(workdir))
                passed.append(check.__name__)
            except AssertionError as exc:
                failures.append(f"{check.__name__}: {exc}")
    return {"passed": passed, "failures": failures}


# --- lean forward ------------------------------------------------------------------------------------------------
def check_lean_forward_vs_hf(device: str) -> dict[str, Any]:
    """The lean decoder's prefill + 8 cached steps give HF's logits (fp32, TF32 off); greedy sampling picks the same
    tokens; its decode speed is reported next to HF's."""
    require("hybridflow_fsdp")
    from hybridflow.engines import ModelSpec, SamplingParams
    from hybridflow.testing.fixtures import EOS_ID, PAD_ID, tiny_model_config
    from hybridflow_fsdp.fast_decode import LeanDecoder
    from hybridflow_fsdp.models import build_model, compute_position_ids
    from hybridflow_fsdp.sampling import sample_tokens

    reset_peak(device)
    model = build_model(ModelSpec(config=tiny_model_config(**WIDE), seed=3), role="rollout").to(device).eval()
    generator = torch.Generator().manual_seed(0)
    rows, width = 32, 10
    ids = torch.randint(4, 45, (rows, width), generator=generator)
    mask = torch.ones(rows, width, dtype=torch.long)
    for row in range(rows):
        mask[row, : row % width] = 0
    ids, mask = ids.masked_fill(mask == 0, PAD_ID).to(device), mask.to(device)
    decoder = LeanDecoder(model)
    errors = []
    with torch.no_grad():
        lean = decoder.prefill(ids, mask, compute_position_ids(mask), 8)
        errors.append(float((lean - model(input_ids=ids, attention_mask=mask).logits[:, -1]).abs().max()))
        positions = compute_position_ids(mask)[:, -1]
        for step in range(8):
            tokens = torch.randint(4, 45, (rows,), generator=torch.Generator().manual_seed(step)).to(device)
            positions = positions + 1
            lean = decoder.step(tokens, positions)
            ids = torch.cat([ids, tokens[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            reference = model(input_ids=ids, attention_mask=mask, position_ids=compute_position_ids(mask)).logits
            errors.append(float((lean - reference[:, -1]).abs().max()))
        decoder.release()
        prompt_ids, prompt_mask = ids[:, :width], mask[:, :width]
        sampling = SamplingParams(temperature=0.0, max_new_tokens=32)
        timings, outputs = {}, {}
        for name, lean_decoder in (("hf", None), ("lean", LeanDecoder(model))):
            for _ in range(2):  # the first pass warms up the kernels
                if device == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                outputs[name] = sample_tokens(model, prompt_ids, prompt_mask, sampling=sampling, eos_token_id=EOS_ID,
                                              pad_token_id=PAD_ID, generator=torch.Generator(device=device),
                                              decoder=lean_decoder)
                if device == "cuda":
                    torch.cuda.synchronize()
                timings[name] = time.perf_counter() - started
    same_tokens = bool(torch.equal(outputs["hf"].responses, outputs["lean"].responses))
    out = {"max_logit_error": max(errors), "errors_per_position": errors, "greedy_tokens_equal": same_tokens,
           "decode_seconds_hf": timings["hf"], "decode_seconds_lean": timings["lean"],
           "lean_speedup": timings["hf"] / max(timings["lean"], 1e-9), "peak_bytes": peak_bytes(device)}
    failures: list[str] = []
    expect(max(errors) < 1e-4, f"lean logits differ from HF by {max(errors)} (> 1e-4)", failures)
    expect(same_tokens, "greedy tokens of the lean decoder differ from HF's", failures)
    out["failures"] = failures
    return out


# --- megatron ----------------------------------------------------------------------------------------------------
def _megatron_rank(rank: int, world_size: int, device: str, workdir: str, out_file: str) -> None:
    """One spawned rank: megatron on ``device`` (NCCL on CUDA) against HF, then the contract suite."""
    _no_tf32()
    import torch.distributed as dist

    from hybridflow.engines import ModelSpec, TrainingEngineConfig
    from hybridflow.testing.contracts import TRAINING_CHECKS
    from hybridflow.testing.contracts.training import build_training_batch
    from hybridflow.testing.fixtures import tiny_model_config
    from hybridflow_megatron import cpu_shim
    from hybridflow_megatron.engine import build_megatron_training_engine
    from hybridflow_megatron.model import build_hf_model

    spec = ModelSpec(config=tiny_model_config(num_heads=4, num_kv_heads=2), seed=3)
    engine = build_megatron_training_engine(role="actor", device=device,
                                            config=TrainingEngineConfig(model=spec, micro_batch_size=4))
    batch = build_training_batch(rows=8)
    log_probs = engine.compute_log_probs(batch)["log_probs"].float().cpu()
    hf = build_hf_model(spec, role="actor").to(device if device == "cpu" else "cuda").eval()
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"].to(hf.device), attention_mask=batch["attention_mask"].to(hf.device),
                    position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0).to(hf.device)).logits
    width = batch["responses"].shape[1]
    reference = torch.log_softmax(logits[:, -width - 1 : -1].float(), -1).gather(
        -1, batch["responses"].to(hf.device).unsqueeze(-1)).squeeze(-1).cpu()
    valid = batch["response_mask"].bool()
    result: dict[str, Any] = {
        "backend": dist.get_backend(), "cpu_shim_active": cpu_shim.is_cpu_shim_active(),
        "parameter_device": str(next(engine.module.parameters()).device),
        "log_prob_gap_vs_hf": float((log_probs - reference).abs()[valid].max()),
        "contracts_passed": [], "contract_failures": [],
    }
    for check in TRAINING_CHECKS:
        try:
            check(lambda role, config: build_megatron_training_engine(role=role, config=config, device=device),
                  Path(workdir))
            result["contracts_passed"].append(check.__name__)
        except AssertionError as exc:
            result["contract_failures"].append(f"{check.__name__}: {exc}")
    if device == "cuda":
        result["peak_bytes"] = int(torch.cuda.max_memory_allocated())
    Path(out_file).write_text(json.dumps(result))


def check_megatron_cuda(device: str) -> dict[str, Any]:
    """megatron-core on ``device`` in a spawned 1-rank process (its parallel state is one per process): NCCL, no
    CPU shim, log-probs equal HF's, and the shared training-engine contract suite."""
    require("megatron.core", "hybridflow_megatron")
    from hybridflow.testing.contracts.spawn import run_ranks

    with tempfile.TemporaryDirectory() as workdir:
        out_file = str(Path(workdir) / "megatron.json")
        run_ranks(_megatron_rank, 1, device, workdir, out_file, workdir=Path(workdir), timeout_s=300)
        result: dict[str, Any] = json.loads(Path(out_file).read_text())
    failures: list[str] = list(result["contract_failures"])
    if device == "cuda":
        expect(result["backend"] == "nccl", f"backend {result['backend']}, expected nccl", failures)
        expect(not result["cpu_shim_active"], "the CPU shim is active on CUDA", failures)
        expect(result["parameter_device"].startswith("cuda"), f"parameters on {result['parameter_device']}", failures)
    expect(result["log_prob_gap_vs_hf"] < 1e-4, f"megatron log-probs differ from HF by {result['log_prob_gap_vs_hf']}",
           failures)
    result["failures"] = failures
    return result


# --- driver ------------------------------------------------------------------------------------------------------
CHECKS: dict[str, Callable[[str], dict[str, Any]]] = {
    "fsdp2_bf16_vs_fp32": check_fsdp2_bf16_vs_fp32,
    "fsdp_contracts": check_fsdp_contracts,
    "lean_forward_vs_hf": check_lean_forward_vs_hf,
    "megatron_cuda": check_megatron_cuda,
}


def _no_tf32() -> None:
    """Exact fp32 matmuls, so fp32 comparisons against HF hold at 1e-4."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda_available": torch.cuda.is_available(), "host": platform.node()}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    total_bytes=torch.cuda.get_device_properties(0).total_memory,
                    nccl=str(torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
    for module in ("transformers", "megatron.core", "hybridflow_fsdp", "hybridflow_megatron", "ray", "vllm"):
        info[f"has_{module}"] = importlib.util.find_spec(module) is not None
    return info


def render_markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = ["# GPU check", "", f"device: {report['device'] or 'none'}; torch {env['torch']}; python {env['python']}"
             + (f"; {env['gpu']} (CUDA {env['cuda']}, NCCL {env['nccl']})" if env.get("gpu") else ""), "",
             "| check | status | seconds | peak CUDA MiB | notes |", "|---|---|---|---|---|"]
    for name, entry in report["checks"].items():
        result = entry.get("result", {})
        peaks = [v for k, v in result.items() if k.startswith("peak_bytes") and isinstance(v, int)]
        peak = f"{max(peaks) / 2**20:.1f}" if peaks else "–"
        notes = entry.get("message") or "; ".join(result.get("failures", [])) or "ok"
        lines.append(f"| {name} | {entry['status']} | {entry['seconds']:.1f} | {peak} | {notes.replace('|', '/')} |")
    lines += ["", "Numbers per check: gpu_check.json."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, run the checks on the CPU (a dry run)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.checks.split(",")) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; expected some of {', '.join(CHECKS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else ("cpu" if args.allow_cpu else None)
    if device == "cuda":
        _no_tf32()
    report: dict[str, Any] = {"device": device, "environment": environment(), "checks": {}}
    for name in args.checks.split(","):
        started = time.perf_counter()
        entry: dict[str, Any]
        try:
            if device is None:
                raise Skip("no CUDA device (torch.cuda.is_available() is False); --allow-cpu runs a CPU dry run")
            result = CHECKS[name](device)
            entry = {"status": "fail" if result.get("failures") else "pass", "result": result}
        except Skip as exc:
            entry = {"status": "skip", "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a crashed check is a failed check; the traceback goes in the report
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            entry = {"status": "fail", "message": f"{type(exc).__name__}: {first_line}",
                     "traceback": traceback.format_exc()}
        entry["seconds"] = time.perf_counter() - started
        report["checks"][name] = entry
        print(f"{name}: {entry['status']} ({entry['seconds']:.1f} s) {entry.get('message', '')}", flush=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(render_markdown(report))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 1 if any(entry["status"] == "fail" for entry in report["checks"].values()) else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
