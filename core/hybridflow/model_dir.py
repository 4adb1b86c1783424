"""Write the Hugging Face directory a rollout engine loads from a :class:`~hybridflow.engines.ModelSpec` given as a
config (random init with the spec's seed and dtype: the trainer's presets and ``model.config``).

Engines that load weights from disk (vLLM, SGLang) use it; what they check of a ``path`` is theirs. Stability:
developer.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hybridflow.engines import ModelSpec
from hybridflow.errors import ConfigError

__all__ = ["hf_checkpoint_tensors", "write_random_init_model_dir", "load_tokenizer"]


def write_random_init_model_dir(spec: ModelSpec, *, prefix: str,
                                engine: str) -> tuple[Path, tempfile.TemporaryDirectory[str]]:
    """config.json plus safetensors weights of ``spec.config`` in a new temporary directory (no tokenizer: engines
    are sent token ids); returns the path and the directory object, whose cleanup the caller owns. The global torch
    RNG is left as it was."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = dict(spec.config or {})
    model_type = config_dict.pop("model_type", None)
    if model_type is None:
        raise ConfigError(
            f"model.config needs a model_type (e.g. 'qwen2') for {engine} to load it; got keys {sorted(config_dict)}. "
            "Use hybridflow.presets.tiny_model_config() for a complete example, or set model.path."
        )
    config = AutoConfig.for_model(model_type, **config_dict)
    holder = tempfile.TemporaryDirectory(prefix=prefix)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        dtype = getattr(torch, spec.dtype)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]  # untyped in HF
        # not model.save_pretrained: under torch.distributed it writes on rank 0 only, and every rank starts its own
        # engine from its own directory
        config.save_pretrained(holder.name)
        save_file(hf_checkpoint_tensors(model), str(Path(holder.name) / "model.safetensors"), metadata={"format": "pt"})
    except BaseException:
        holder.cleanup()
        raise
    finally:
        torch.random.set_rng_state(generator_state)
    return Path(holder.name), holder


def hf_checkpoint_tensors(model: Any) -> dict[str, Any]:
    """``model``'s tensors named and shaped as transformers' ``save_pretrained`` writes them (what the Hub holds and
    vLLM loads): the conversion transformers applies when loading reverted — in transformers 5 a mixture-of-experts
    model (Mixtral, Qwen3-MoE) holds its experts fused ([E, 2I, H] ``mlp.experts.gate_up_proj``), its checkpoints one
    tensor per expert (Mixtral's ``block_sparse_moe.experts.<e>.w1/w2/w3``) — and a tied ``lm_head`` left out (it is
    the embedding). Each tensor owns its storage (safetensors refuses shared ones). Written directly rather than by
    ``save_pretrained``, which under torch.distributed writes on rank 0 only."""
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the modules' names are the checkpoint's
        pass
    else:
        state = dict(revert_weight_conversion(model, state))
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen or not tensor.is_contiguous() else tensor
        seen.add(pointer)
    return out


#: tokenizer classes that mean "the tokenizers file as it is" (what ``PreTrainedTokenizerFast.save_pretrained`` writes)
_GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in the HF directory ``path``, as the directory says.

    ``AutoTokenizer`` in transformers 5 picks the tokenizer class from the *model type* (a ``qwen2`` directory gets
    ``Qwen2Tokenizer``, whose pre-tokenizer drops the spaces a character tokenizer keeps); a directory whose
    ``tokenizer_config.json`` names a generic fast tokenizer (what ``hybridflow sft``, ``hybridflow export`` and the
    presets write for the character tokenizer) is loaded as exactly that file instead.
    """
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_file = Path(path) / "tokenizer_config.json"
    if config_file.is_file() and (Path(path) / "tokenizer.json").is_file():
        declared = json.loads(config_file.read_text()).get("tokenizer_class")
        if declared in _GENERIC_TOKENIZER_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))
