"""``hybridflow sft`` without Ray: the shipped demonstrations, the loss, the batch layout, clear errors on bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.char_tokenizer import EOS_ID, PAD_ID, build_char_tokenizer
from hybridflow.config import load_config
from hybridflow.data import make_task_rows
from hybridflow.errors import ConfigError, DatasetError
from hybridflow.tasks.arithmetic import make_sft_rows, write_sft_files
from hybridflow.trainer.sft import (
    PROMPT_FIELD,
    RESPONSE_FIELD,
    SFTLoss,
    SFTTrainer,
    build_sft_batch,
    load_demonstrations,
    load_sft_config,
    main,
)

ROOT = Path(__file__).resolve().parents[2]
SFT_EXAMPLE = ROOT / "examples" / "sft_arithmetic.yaml"
GRPO_EXAMPLE = ROOT / "examples" / "grpo_arithmetic_scratch.yaml"


def test_shipped_demonstrations_are_the_task_code_output_and_exclude_held_out_sums(tmp_path: Path) -> None:
    written = write_sft_files(tmp_path)
    for path in written:
        assert path.read_bytes() == (ROOT / "examples" / "data" / path.name).read_bytes(), (
            f"examples/data/{path.name} is stale: regenerate it with `python -m hybridflow.tasks.arithmetic`")
    # the split is the RL example's: its held-out validation prompts never appear among the demonstrations
    task = load_config(GRPO_EXAMPLE, ["model.path=null", "model.preset=tiny-qwen2"]).data.task
    assert task is not None and task.num_val_prompts > 0
    train_rows, held_out = make_task_rows(task)
    demonstrations, validation = make_sft_rows(max_operand=task.max_operand, seed=task.seed,
                                               num_prompts=task.num_prompts, num_val_prompts=task.num_val_prompts)
    held_out_prompts = {row["prompt"] for row in held_out}
    assert {row["prompt"] for row in validation} == held_out_prompts
    assert not held_out_prompts & {row["prompt"] for row in demonstrations}
    assert {row["prompt"] for row in demonstrations} == {row["prompt"] for row in train_rows}
    for row in demonstrations + validation:  # every response is the correct sum
        a, b = row["prompt"].removesuffix("=").split("+")
        assert row["response"] == str(int(a) + int(b)) == row["reward_model"]["ground_truth"]


def test_sft_batch_layout_and_loss_is_the_masked_token_mean_nll() -> None:
    tokenizer = build_char_tokenizer()
    rows = [{PROMPT_FIELD: "7+5=", RESPONSE_FIELD: "12"}, {PROMPT_FIELD: "1+1=", RESPONSE_FIELD: "2"}]
    batch = build_sft_batch(rows, tokenizer, max_prompt_length=6, max_response_length=4)
    assert batch["prompts"][1].tolist()[:2] == [PAD_ID, PAD_ID]  # left-padded prompts
    assert batch["responses"][0, 2].item() == EOS_ID and batch["responses"][1, 1].item() == EOS_ID
    assert batch["response_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]  # the answer and its EOS
    assert tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()]) == "7+5=12<eos>"
    log_probs = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.9], [0.5, 0.5, 0.1, 0.1]]))
    # the engine's convention: the mini-batch's valid tokens (5) in meta; two ranks → each holds its share
    loss, metrics = SFTLoss()({"log_probs": log_probs}, batch.with_meta(loss_scale_tokens=5.0))
    expected = -(math.log(0.5) + math.log(0.25) + math.log(0.125) + 2 * math.log(0.5)) / 5
    assert float(loss) == pytest.approx(expected)
    assert metrics["nll"] == pytest.approx(expected)


def _config(tmp_path: Path, *overrides: str) -> list[str]:
    return [f"trainer.run_dir={tmp_path / 'run'}", *overrides]


def test_missing_demonstrations_file_is_a_clear_error(tmp_path: Path) -> None:
    config = load_sft_config(SFT_EXAMPLE, _config(tmp_path, f"data.train_files=[{tmp_path / 'nope.jsonl'}]"))
    with pytest.raises(DatasetError, match=r"demonstrations file .*nope\.jsonl does not exist.*data\.train_files"):
        SFTTrainer(config)


def test_wrong_columns_name_the_missing_column_and_the_keys(tmp_path: Path) -> None:
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(2)))
    config = load_sft_config(SFT_EXAMPLE, _config(tmp_path, f"data.train_files=[{path}]"))
    with pytest.raises(DatasetError, match=r"row 0 lacks column\(s\) \['prompt', 'response'\]; found "
                                           r"\['answer', 'question'\].*data\.prompt_key"):
        SFTTrainer(config)
    # naming the columns fixes it (verl's data.prompt_key / data.response_key)
    fixed = load_sft_config(SFT_EXAMPLE, _config(tmp_path, f"data.train_files=[{path}]", "data.val_files=[]",
                                                 "data.prompt_key=question", "data.response_key=answer",
                                                 "data.batch_size=2", "resource_pools.main.devices_per_node=[1]"))
    SFTTrainer(fixed)


def test_bad_values_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "response": 2}) + "\n")
    config = load_sft_config(SFT_EXAMPLE, _config(tmp_path, f"data.train_files=[{path}]"))
    with pytest.raises(DatasetError, match="column 'response' must be text, got int"):
        SFTTrainer(config)
    with pytest.raises(DatasetError, match=r"has 3 tokens with the EOS, more than data.max_response_length=2"):
        SFTTrainer(load_sft_config(SFT_EXAMPLE, _config(tmp_path, "data.max_response_length=2")))
    with pytest.raises(ConfigError, match=r"data.batch_size = 3 rows must be a multiple of the 2 ranks"):
        load_sft_config(SFT_EXAMPLE, _config(tmp_path, "data.batch_size=3"))
    with pytest.raises(ConfigError, match=r'Unknown config key "trainer\.totl_steps" \(given 3\)\. Did you mean '
                                          r'"trainer\.total_steps"\?'):
        load_sft_config(SFT_EXAMPLE, _config(tmp_path, "trainer.totl_steps=3"))


def test_cli_reports_bad_input_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([str(SFT_EXAMPLE), *_config(tmp_path, f"data.train_files=[{tmp_path / 'nope.jsonl'}]")])
    assert code == 2
    err = capsys.readouterr().err
    assert "hybridflow sft: DatasetError: demonstrations file" in err and "Traceback" not in err
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "config file" in capsys.readouterr().err


def test_example_files_resolve_from_the_config_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # not the repository root: the example's data/ paths are the YAML's folder's
    config = load_sft_config(SFT_EXAMPLE)
    assert [Path(f) for f in config.data.train_files] == [ROOT / "examples" / "data" / "arithmetic_sft.jsonl"]
    trainer = SFTTrainer(config)
    assert len(trainer.train_rows) == 80 and len(trainer.val_rows) == 20
    assert isinstance(trainer.train_batch, Batch)


def test_a_single_demonstrations_path_is_a_list_anchored_or_home_expanded(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's ``data.train_files: file`` (one path, not a list): relative to the YAML's folder, ``~`` expanded."""
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = tmp_path / "cfg"
    folder.mkdir()
    row = json.dumps({"prompt": "1+1=", "response": "2"}) + "\n"
    (folder / "demos.jsonl").write_text(row * 3)
    (tmp_path / "val.jsonl").write_text(row)
    yaml_file = folder / "sft.yaml"
    yaml_file.write_text("data:\n  train_files: demos.jsonl\n  val_files: ~/val.jsonl\n")
    config = load_sft_config(yaml_file, _config(tmp_path))
    assert config.data.train_files == [str(folder / "demos.jsonl")]
    assert config.data.val_files == [str(tmp_path / "val.jsonl")]
    assert len(load_demonstrations(config.data.val_files, prompt_key="prompt", response_key="response")) == 1
    overridden = load_sft_config(yaml_file, _config(tmp_path, "data.train_files=~/val.jsonl"))
    assert overridden.data.train_files == [str(tmp_path / "val.jsonl")]


def test_exact_reward_of_the_main_job_gives_no_partial_credit() -> None:
    from hybridflow.rewards import resolve_reward_function, score_responses

    responses, truths = ["12", "13", "1", " 12 and more", "7"], ["12", "12", "12", "12", "12"]
    exact = score_responses(resolve_reward_function("arithmetic_exact"), responses=responses, ground_truths=truths,
                            data_sources=["hybridflow/arithmetic"] * 5)
    partial = score_responses(resolve_reward_function("arithmetic"), responses=responses, ground_truths=truths,
                              data_sources=["hybridflow/arithmetic"] * 5)
    assert exact.scores == [1.0, 0.0, 0.0, 0.0, 0.0]  # the whole response: nothing may follow the answer
    assert partial.scores == [1.0, 0.25, 0.25, 1.0, 0.0]  # the from-scratch example's reward credits leading digits


def test_a_broken_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text("data: {train_files: [a.jsonl]\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_sft_config(path)


def test_verl_sft_layout_dict_keys_and_chat_prompts(tmp_path: Path) -> None:
    """verl's SFT keys: ``prompt_key: extra_info`` + ``prompt_dict_keys: [question]`` reaches into a dict column; a
    prompt given as chat messages goes through the tokenizer's chat template, as the RL dataset renders it."""
    path = tmp_path / "demos.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "7+5="}], "extra_info": {"question": "7+5=", "answer": "12"}}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    by_dict = load_demonstrations([str(path)], prompt_key="extra_info", response_key="extra_info",
                                  prompt_dict_keys=["question"], response_dict_keys=["answer"])
    assert (by_dict[0][PROMPT_FIELD], by_dict[0][RESPONSE_FIELD]) == ("7+5=", "12")
    chat = load_demonstrations([str(path)], prompt_key="prompt", response_key="extra_info",
                               response_dict_keys=["answer"])
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}" \
                              "={% endif %}"
    batch = build_sft_batch(chat, tokenizer, max_prompt_length=6, max_response_length=4)
    assert tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()]) == "7+5==12<eos>"
    with pytest.raises(DatasetError, match=r"'extra_info' has no key 'query' \(found \['answer', 'question'\]\)"):
        load_demonstrations([str(path)], prompt_key="extra_info", response_key="extra_info",
                            prompt_dict_keys=["query"], response_dict_keys=["answer"])


def test_train_cli_reports_bad_input_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``hybridflow train`` shares the error handling of ``hybridflow sft`` (one line, exit code 2)."""
    from hybridflow.trainer.cli import main as train_main

    assert train_main([str(ROOT / "examples" / "grpo_arithmetic_scratch.yaml"), "trainer.totl_steps=3"]) == 2
    err = capsys.readouterr().err
    assert "hybridflow train: ConfigError: " in err and "totl_steps" in err and "Traceback" not in err
