"""Model config files (issue #20): a config that lacks a field its architecture needs, names no or an unsupported
model_type, carries another architecture's keys, or is not a JSON object at all is refused in one line naming the
file and the field, for --model_config and --init_from, in-process and from `train.py`; every preset and every
config transformers writes still loads."""

import json
import sys

import pytest
from conftest import run

from deepseek_zero3.cli import UserError
from deepseek_zero3.model import models


def preset(name: str) -> dict:
    return json.loads((models.MODEL_CONFIG_DIR / f"{name}.json").read_text())


def without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


# (config dict, what the error must say). Each one was planned and built by transformers' defaults before.
REFUSED = {
    "llama without hidden_size": (without(preset("tiny"), "hidden_size"), "lacks hidden_size, which a llama model"),
    "llama without layers and heads": (
        without(preset("tiny"), "num_hidden_layers", "num_attention_heads"),
        "lacks num_hidden_layers, num_attention_heads",
    ),
    "v3 without its MoE and MLA fields": (
        without(preset("deepseek-v3-tiny"), "n_routed_experts", "kv_lora_rank", "q_lora_rank"),
        "lacks q_lora_rank, kv_lora_rank, n_routed_experts, which a deepseek_v3 model",
    ),
    "v3 without num_key_value_heads": (
        without(preset("deepseek-v3-tiny"), "num_key_value_heads"),
        "lacks num_key_value_heads",
    ),
    "v3 without model_type": (
        without(preset("deepseek-v3-tiny"), "model_type"),
        'has no model_type, so its fields would be read as a Llama\'s; add "model_type": "deepseek_v3"',
    ),
    "llama without model_type": (without(preset("tiny"), "model_type"), 'add "model_type": "llama"'),
    "unsupported model_type": (
        {**preset("tiny"), "model_type": "mistral", "architectures": ["MistralForCausalLM"]},
        (
            'model_type \'mistral\', which train.py does not build; the supported ones are "llama" or "qwen3" or '
            '"deepseek_v3"'
        ),
    ),
    "MoE keys under llama": (
        {**preset("tiny"), "n_routed_experts": 8, "num_experts_per_tok": 2},
        (
            "has n_routed_experts, num_experts_per_tok, which a llama model does not use (transformers would ignore "
            'them): set "model_type": "deepseek_v3"'
        ),
    ),
    "v3 file relabelled llama": (
        {**without(preset("deepseek-v3-tiny"), "architectures"), "model_type": "llama"},
        "which a llama model does not use",
    ),
    "a misspelt key": (
        {**preset("tiny"), "rope_thetta": 5e5},
        "has rope_thetta, which a llama model does not use (transformers would ignore it): remove it or fix the",
    ),
    "architectures disagree": (
        {**preset("tiny"), "architectures": ["DeepseekV3ForCausalLM"]},
        "has model_type 'llama' but architectures ['DeepseekV3ForCausalLM']",
    ),
    "hidden_size a string": (
        {**preset("tiny"), "hidden_size": "64"},
        'has hidden_size="64"; it must be an integer >= 1',
    ),
    "zero layers": ({**preset("tiny"), "num_hidden_layers": 0}, "num_hidden_layers=0; it must be an integer >= 1"),
    "q_lora_rank zero": (
        {**preset("deepseek-v3-tiny"), "q_lora_rank": 0},
        "q_lora_rank=0; it must be an integer >= 1 or null",
    ),
    # Sizes that do not fit together (issue #59): a StrictDataclassClassValidationError traceback, a RuntimeError in
    # the first forward pass (the plan's timing), or, for the routing, a model that trains with tokens sent to experts
    # outside the groups it chose.
    "heads not dividing hidden_size": (
        {**preset("tiny"), "num_attention_heads": 3},
        "has num_attention_heads=3, which does not divide hidden_size=64",
    ),
    "KV heads not dividing the heads": (
        {**preset("tiny"), "num_key_value_heads": 3},
        "has num_key_value_heads=3, which does not divide num_attention_heads=4",
    ),
    "odd head_dim": ({**preset("tiny"), "head_dim": 15}, "has head_dim=15, an odd number"),
    "KV heads a string": (
        {**preset("tiny"), "num_key_value_heads": "2"},
        "is refused by transformers: Validation error for field 'num_key_value_heads'",
    ),
    "v3 KV heads other than the heads": (
        {**preset("deepseek-v3-tiny"), "num_key_value_heads": 2},
        "has num_key_value_heads=2 and num_attention_heads=4; in a deepseek_v3 model",
    ),
    "v3 odd rotary dimension": (
        {**preset("deepseek-v3-tiny"), "qk_rope_head_dim": 7},
        "has qk_rope_head_dim=7, an odd number",
    ),
    "v3 groups not dividing the experts": (
        {**preset("deepseek-v3-tiny"), "n_group": 3},
        "has n_group=3, which does not divide n_routed_experts=8",
    ),
    "v3 one expert per group": (
        {**preset("deepseek-v3-tiny"), "n_group": 8, "topk_group": 2},
        "has n_routed_experts=8 in n_group=8 groups: 1 expert per group",
    ),
    "v3 more groups chosen than there are": (
        {**preset("deepseek-v3-tiny"), "topk_group": 3},
        "has topk_group=3, more than its n_group=2 groups",
    ),
    "v3 more experts per token than the chosen groups hold": (
        {**preset("deepseek-v3-tiny"), "num_experts_per_tok": 5},
        "has num_experts_per_tok=5, more than the 4 experts of its topk_group=1 group(s)",
    ),
    # The switches (issue #61): a model that would train as one thing and export as another.
    "QK-norm on MLA": (
        {**preset("deepseek-v3-tiny"), "qk_norm": True},
        (
            "has \"qk_norm\" under model_type 'deepseek_v3', whose transformers architecture (DeepseekV3) has no "
            "QK-norm to export the model with; remove it (QK-norm is a switch of the dense llama configs"
        ),
    ),
    "qk_norm not a boolean": ({**preset("tiny"), "qk_norm": "yes"}, 'has "qk_norm": "yes"; it must be true or false'),
    "QK-norm with MLP biases": (
        {**preset("tiny-qk-norm"), "mlp_bias": True},
        'has "qk_norm": true and "mlp_bias": true; a llama model with QK-norm is transformers\' Qwen3 architecture',
    ),
    "qwen3 without head_dim": (
        {**without(preset("tiny"), "architectures"), "model_type": "qwen3"},
        (
            "lacks head_dim, which a qwen3 model needs (transformers' defaults describe another model); add them, or "
            'write it as a llama config with "qk_norm": true (as'
        ),
    ),
    "qwen3 with a sliding window": (
        {
            **preset("tiny"),
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "head_dim": 16,
            "use_sliding_window": True,
        },
        "has use_sliding_window=true; train.py trains, masks documents and plans full attention in every layer",
    ),
}


@pytest.mark.parametrize("case", REFUSED, ids=str)
def test_incomplete_or_foreign_configs_are_refused(case, tmp_path):
    d, message = REFUSED[case]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        models.load_model_config(str(path), "", 32, None)
    assert f"--model_config {path}" in str(e.value) and message in str(e.value), str(e.value)
    # A Hugging Face directory given as --init_from (or as --model_config) goes through the same check.
    for model_config, init_from, flag in (
        (str(tmp_path), "", "--model_config"),
        ("tiny", str(tmp_path), "--init_from"),
    ):
        with pytest.raises(UserError) as e:
            models.load_model_config(model_config, init_from, 32, None)
        assert f"{flag} {path}" in str(e.value) and message in str(e.value), str(e.value)


# (file bytes, what the error must say): json.loads raised JSONDecodeError / UnicodeDecodeError with no file name.
DAMAGED = {
    "torn": (
        json.dumps(preset("tiny"))[:70].encode(),
        "is not valid JSON (Unterminated string starting at: line 1 column 64)",
    ),
    "syntax error": (
        b'{\n  "hidden_size": 64,\n  "vocab_size": 512,,\n}',
        "is not valid JSON (Expecting property name enclosed in double quotes: line 3 column 21)",
    ),
    "empty": (b"", "is empty"),
    "whitespace": (b" \n\n", "is empty"),
    "a list": (b"[1, 2]", "holds a JSON list where a JSON object belongs"),
    "a string": (b'"tiny"', "holds a JSON str where a JSON object belongs"),
    "not UTF-8": (b'{"model_type": "llama\xff"}', "byte 21 is not UTF-8"),
}


@pytest.mark.parametrize("case", DAMAGED, ids=str)
def test_damaged_config_files_are_refused_with_their_position(case, tmp_path):
    content, message = DAMAGED[case]
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(UserError) as e:
        models.load_model_config(str(path), "", 32, None)
    assert str(e.value).startswith(f"--model_config {path}") and message in str(e.value), str(e.value)


def test_init_from_must_be_a_model_directory(tmp_path):
    """`--init_from tiny` used to read the tiny preset as if it were a model directory (in --plan)."""
    for init_from in ("tiny", str(tmp_path)):
        with pytest.raises(UserError, match=r"--init_from .* is not a Hugging Face model directory \(no config.json\)"):
            models.load_model_config("tiny", init_from, 32, None)


def test_presets_and_configs_transformers_writes_still_load(tmp_path):
    """No false refusals: every preset, what save_pretrained writes for each architecture (train.py's OUT/final),
    and a Hub-style config with the keys older transformers versions wrote."""
    for path in sorted(models.MODEL_CONFIG_DIR.glob("*.json")):
        models.load_model_config(path.stem, "", 128, None)
    for name in ("tiny", "tiny-qk-norm", "deepseek-v3-tiny"):
        config = models.load_model_config(name, "", 32, {"vocab_size": 500, "eos_id": 0})
        config.save_pretrained(tmp_path / name)
        assert models.load_model_config("", str(tmp_path / name), 32, None).to_dict() == config.to_dict()
    hub = {**preset("tiny"), "_name_or_path": "x", "pretraining_tp": 1, "rope_scaling": None, "torch_dtype": "bfloat16",
           "transformers_version": "4.33.1", "use_cache": True, "max_length": 20}  # fmt: skip
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "config.json").write_text(json.dumps(hub))
    assert models.load_model_config("", str(tmp_path / "hub"), 32, None).hidden_size == 64


@pytest.mark.parametrize(
    "case",
    [
        "torn",
        "llama without hidden_size",
        "KV heads not dividing the heads",
        "v3 one expert per group",
        "QK-norm on MLA",
    ],
    ids=str,
)
@pytest.mark.slow
def test_train_plan_refuses_in_one_line(case, tmp_path):
    path = tmp_path / "bad.json"
    if case in DAMAGED:
        path.write_bytes(DAMAGED[case][0])
    else:
        path.write_text(json.dumps(REFUSED[case][0]))
    proc = run([sys.executable, "train.py", "--plan", "--data_dir", "none", "--model_config", path], check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: --model_config {path}") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.slow
def test_train_refuses_a_torn_config_before_writing(docs_data, tmp_path):
    """A real (unlaunched) training start: the error line, exit 2, and no output directory."""
    path = tmp_path / "bad.json"
    path.write_bytes(DAMAGED["torn"][0])
    out = tmp_path / "out"
    cmd = [sys.executable, "train.py", "--model_config", path, "--data_dir", docs_data, "--output_dir", out]
    proc = run(cmd, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and f"error: --model_config {path} is not valid JSON (" in output, output
    assert "Traceback" not in output and not out.exists()
