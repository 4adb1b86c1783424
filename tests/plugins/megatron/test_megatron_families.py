"""The megatron engine per model family against ``transformers`` on the same weights (issue #42 item 1).

The converted families (:data:`hybridflow_megatron.convert.CONVERTED_FAMILIES`: llama, qwen2, qwen3 with its q/k
norms as megatron's ``q_layernorm``/``k_layernorm``) load from an HF directory whose every tensor is moved off its init
(the norms included), and their logits and log-probs equal the HF model's (fp32, 1e-5) at t = 1 on one rank, the
generation weights read back equal to the HF ones. The qwen3 directory has Qwen3's RoPE base (1e6, in transformers 5's
``rope_parameters``: a base read from the old ``rope_theta`` attribute would silently be 10000). The mixture-of-experts
families are refused when the engine reads the config, naming the family and the engines that run it.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.errors import ConfigError
from hybridflow.presets import save_tiny_model, tiny_model_config
from hybridflow_megatron.convert import CONVERTED_FAMILIES, read_arch_info

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
pytestmark = pytest.mark.megatron

ATOL = 1e-5


@pytest.fixture(scope="module")
def family_logits(module_ranks, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One 1-rank process: the logits case of every converted family, each from a perturbed HF directory."""
    root = tmp_path_factory.mktemp("families")
    paths = [save_tiny_model(root / family, perturb=0.3, architecture=family, tie_word_embeddings=family != "qwen3")
             for family in CONVERTED_FAMILIES]
    qwen3_config = paths[CONVERTED_FAMILIES.index("qwen3")] / "config.json"
    values = json.loads(qwen3_config.read_text())
    values["rope_parameters"] = {**values["rope_parameters"], "rope_theta": 1_000_000.0}  # Qwen3's own base
    qwen3_config.write_text(json.dumps(values))
    cases = [{"scenario": "logits", "path": str(path)} for path in paths]
    (result,) = module_ranks("cases", 1, {"cases": cases}, timeout_s=600)
    return dict(zip(CONVERTED_FAMILIES, result["cases"], strict=True))


@pytest.mark.slow  # the module's one megatron process: ~25 s alone, up to 80 s on a loaded box
@pytest.mark.parametrize("family", CONVERTED_FAMILIES)
def test_converted_family_logits_equal_transformers(family_logits: dict[str, dict], family: str) -> None:
    result = family_logits[family]
    valid = result["attention_mask"].bool()
    gap = (result["logits"] - result["hf_logits"]).abs()[valid].max().item()
    assert gap < ATOL, f"{family}: megatron logits differ from transformers by {gap}"
    hf_log_probs = torch.log_softmax(result["hf_logits"][:, -5:-1], -1)
    expected = hf_log_probs.gather(-1, result["responses"].unsqueeze(-1)).squeeze(-1)
    assert (result["log_probs"] - expected).abs().max().item() < ATOL
    assert result["weights_equal"] and result["weights_missing"] == [], result["weights_missing"]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_families_are_refused_naming_family_and_engine(family: str) -> None:
    from transformers import AutoConfig

    values = tiny_model_config(architecture=family)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with pytest.raises(ConfigError, match=rf"megatron engine converts .*got model_type='{family}' \(a mixture-of-"
                                          r"experts model.*Fix: train it with actor.engine=fsdp or deepspeed"):
        read_arch_info(config, tp_size=1)
