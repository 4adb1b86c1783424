"""bf16 against fp32 compute on this CPU, one process, 1 thread: what ``mixed_precision: auto`` decides on.

Four measurements per model size of ``bench/e2e_grpo.py`` (77K, 2.4M, 18.9M), fp32 and bf16 interleaved, medians of
``--repeats``:
- ``matmul``: ``F.linear`` of [rows x hidden] by [3*hidden x hidden] at 32, 64, 128 and 1024 rows (GFLOP/s);
- ``attention``: causal SDPA forward + backward over 6 and 64 rows of 21 tokens (the model's heads) with bf16 inputs
  in bf16, the same inputs upcast to fp32 (what the training forward runs on CPU: ``upcast_for_backward``), fp32;
- ``generate``: the rollout engine's lean decoder (prefill once per prompt, 16 prompts x 4 samples, 16 new tokens,
  greedy) on fp32 weights and on bf16 weights (``rollout.dtype: bfloat16``);
- ``train``: the lean forward + log-softmax + backward over the 64 rows (5-token prompts, 16-token responses) in fp32
  and under bf16 autocast (what FSDP's bf16 compute runs; its casts are in the all-gather instead).
One ``RESULT {json}`` line per size with the seconds, the bf16/fp32 speedups, and ``auto``'s choice for the size on
this machine (``hybridflow.precision``).

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=core:plugins/fsdp .venv/bin/python bench/mixed_precision.py [--sizes 20m]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import results_page

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPTS, SAMPLES, PROMPT_LENGTH, NEW_TOKENS = 16, 4, 5, 16


def _median_s(function: Callable[[], None], repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(size: str, repeats: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from e2e_fixture import model_config_of
    from hybridflow.engines import ModelSpec
    from hybridflow.precision import resolve_mixed_precision
    from hybridflow_fsdp.fast_decode import build_lean_decoder
    from hybridflow_fsdp.lean_forward import LeanForward

    torch.set_num_threads(1)
    values = model_config_of(size)
    torch.manual_seed(0)
    fp32 = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values)).float()
    bf16 = AutoModelForCausalLM.from_config(fp32.config)
    bf16.load_state_dict(fp32.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    hidden = int(fp32.config.hidden_size)
    vocab = int(fp32.config.vocab_size)
    prompts = torch.randint(3, vocab, (PROMPTS, PROMPT_LENGTH))
    rows = torch.cat([prompts.repeat_interleave(SAMPLES, 0), torch.randint(3, vocab, (PROMPTS * SAMPLES, NEW_TOKENS))],
                     dim=1)

    def generate(model: Any) -> Callable[[], None]:
        def run() -> None:
            decoder = build_lean_decoder(model)
            assert decoder is not None
            positions = torch.arange(PROMPT_LENGTH).expand(PROMPTS, PROMPT_LENGTH)
            logits = decoder.prefill(prompts, torch.ones_like(prompts), positions, NEW_TOKENS, repeats=SAMPLES)
            for _ in range(NEW_TOKENS):
                logits = decoder.step(logits.argmax(-1))
            decoder.release()
        return run

    def train(autocast: bool) -> Callable[[], None]:
        lean = LeanForward(fp32)

        def run() -> None:
            positions = torch.arange(rows.shape[1]).expand_as(rows)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = lean.response_logits(rows, torch.ones_like(rows), positions, NEW_TOKENS)
            picked = torch.log_softmax(logits.float(), -1).gather(-1, rows[:, PROMPT_LENGTH:, None])
            picked.sum().backward()
            fp32.zero_grad(set_to_none=True)
        return run

    matmul: dict[str, dict[str, float]] = {}
    for count in (32, 64, 128, 1024):
        entry = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            x, w = torch.randn(count, hidden, dtype=dtype), torch.randn(3 * hidden, hidden, dtype=dtype)
            seconds = _median_s(lambda x=x, w=w: [F.linear(x, w) for _ in range(20)] and None, repeats)
            entry[f"{name}_gflops"] = round(20 * 2 * count * hidden * 3 * hidden / seconds / 1e9, 1)
        entry["bf16_over_fp32"] = round(entry["bf16_gflops"] / entry["fp32_gflops"], 2)
        matmul[str(count)] = entry
    # causal SDPA forward + backward over rows of rollout length (the heads of the model), as the packed training
    # forward calls it: bf16 inputs in bf16, bf16 inputs upcast to fp32 (what the trainer runs), fp32 inputs
    from hybridflow_fsdp.lean_forward import upcast_for_backward

    heads, kv_heads = int(fp32.config.num_attention_heads), int(fp32.config.num_key_value_heads)
    head_dim = hidden // heads
    attention: dict[str, dict[str, float]] = {}
    for count in (6, 64):
        entry = {}
        for name, dtype, upcast in (("bf16", torch.bfloat16, False), ("bf16_upcast", torch.bfloat16, True),
                                    ("fp32", torch.float32, False)):
            q, k, v = (torch.randn(count, n, PROMPT_LENGTH + NEW_TOKENS, head_dim, dtype=dtype, requires_grad=True)
                       for n in (heads, kv_heads, kv_heads))
            assert upcast_for_backward(q) == (dtype == torch.bfloat16)  # the trainer upcasts these bf16 inputs

            def step(q: Any = q, k: Any = k, v: Any = v, upcast: bool = upcast) -> None:
                inputs = (q.float(), k.float(), v.float()) if upcast else (q, k, v)
                F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=heads != kv_heads).sum().backward()
            entry[f"{name}_ms"] = round(_median_s(step, repeats) * 1e3, 3)
        entry["bf16_over_upcast"] = round(entry["bf16_ms"] / entry["bf16_upcast_ms"], 2)
        attention[str(count)] = entry
    functions = {"generate_fp32": generate(fp32), "generate_bf16": generate(bf16), "train_fp32": train(False),
                 "train_bf16": train(True)}
    times: dict[str, list[float]] = {name: [] for name in functions}
    for function in functions.values():
        function()  # warm-up
    for _ in range(repeats):  # round robin: fp32 and bf16 see the same load
        for name, function in functions.items():
            started = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - started)
    seconds = {name: statistics.median(values) for name, values in times.items()}
    parameters = sum(p.numel() for p in fp32.parameters())
    return {"size": size, "parameters": parameters, "matmul_rows": matmul, "attention_rows": attention,
            "seconds": {k: round(v, 4) for k, v in seconds.items()},
            "generate_bf16_speedup": round(seconds["generate_fp32"] / seconds["generate_bf16"], 2),
            "train_bf16_speedup": round(seconds["train_fp32"] / seconds["train_bf16"], 2),
            "auto_resolves_to": resolve_mixed_precision("auto", engine="fsdp", device="cpu",
                                                        model=ModelSpec(config=model_config_of(size))),
            "cpu_bf16_native": bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()),
            "load_avg_1m": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="77k,2.4m,20m")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for size in args.sizes.split(","):
        results_page.result(measure(size.strip(), args.repeats))


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="bf16 vs fp32 compute on this CPU"))
