"""Write a verl-format GSM8K-style job to a folder: train/test parquet in verl's columns, and a tiny Qwen2 model
directory with a byte-level BPE tokenizer and a ChatML chat template, all built locally (no hub).

It is what ``examples/data_preprocess/gsm8k.py`` gives a verl user, on synthetic grade-school word problems (GSM8K
itself is not downloadable here). Columns, as verl writes them:

- ``data_source``: ``"openai/gsm8k"``
- ``prompt``: chat messages ``[{"role": "user", "content": question + instruction}]``
- ``ability``: ``"math"``
- ``reward_model``: ``{"style": "rule", "ground_truth": "42"}``
- ``extra_info``: ``{"split", "index", "answer", "question"}``

Usage (from the repository root)::

    python examples/verl_gsm8k/prepare.py --out runs/verl-gsm8k
    hybridflow train examples/grpo_verl_gsm8k.yaml
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jade")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "shells")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen2 models ship it (tool schemas are not used by this task)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, GSM8K-style worked answer ending in ``#### n``, n)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 9)
    kind = rng.choice(("buy", "give", "boxes"))
    if kind == "buy":
        n = a + b
        question = f"{name} has {a} {item}. {name} buys {b} more. How many {item} does {name} have now?"
        answer = f"{name} has {a} + {b} = <<{a}+{b}={n}>>{n} {item}.\n#### {n}"
    elif kind == "give":
        a = max(a, b + 1)
        n = a - b
        question = f"{name} has {a} {item} and gives {b} away. How many {item} are left?"
        answer = f"{name} has {a} - {b} = <<{a}-{b}={n}>>{n} {item} left.\n#### {n}"
    else:
        n = a * b
        question = f"{name} fills {b} boxes with {a} {item} each. How many {item} are in the boxes?"
        answer = f"There are {b} * {a} = <<{b}*{a}={n}>>{n} {item}.\n#### {n}"
    return question, answer, n


def verl_rows(count: int, *, split: str, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(f"{split}-{seed}")
    rows = []
    for index in range(count):
        question, answer, n = word_problem(rng)
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(n)},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
        })
    return rows


def write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def build_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE trained on ``texts``, wrapped as a transformers fast tokenizer with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def save_model_dir(path: Path, tokenizer: Any, *, seed: int) -> None:
    """A random-init tiny Qwen2 (hidden 64, 2 layers) sized to the tokenizer, written as an HF directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    vocab = len(tokenizer)
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(path)


def prepare(out: Path, *, num_train: int = 512, num_test: int = 64, vocab_size: int = 400, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    data.mkdir(exist_ok=True)
    train, test = verl_rows(num_train, split="train", seed=seed), verl_rows(num_test, split="test", seed=seed)
    write_parquet(train, data / "train.parquet")
    write_parquet(test, data / "test.parquet")
    texts = [r["prompt"][0]["content"] + "\n" + r["extra_info"]["answer"] for r in train] + ["user assistant\n"]
    save_model_dir(out / "model", build_tokenizer(texts, vocab_size), seed=seed)
    (out / "README.txt").write_text(json.dumps({"train_rows": num_train, "test_rows": num_test,
                                                "vocab_size": vocab_size, "seed": seed}) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/verl-gsm8k"))
    parser.add_argument("--num-train", type=int, default=512)
    parser.add_argument("--num-test", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = prepare(args.out, num_train=args.num_train, num_test=args.num_test, vocab_size=args.vocab_size,
                  seed=args.seed)
    print(f"wrote {out}/data/{{train,test}}.parquet and {out}/model")


if __name__ == "__main__":
    main()
