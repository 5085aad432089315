"""Which model: the config presets and config.json files (checked before transformers fills gaps with another
model's defaults), model directories (their weight files and tokenizer), and the vocabulary taken from the data.

    load_model_config      a preset, config.json or model directory -> the transformers config train.py builds
    architecture / config_differences / check_model_unchanged    a resumed run's model against the file it named
    read_config_json / check_model_fields / build_model_config   its three checks, also used on checkpoints
    dense_variant          a dense config's switches ("qk_norm": true) as the transformers architecture that has them
    check_weight_files / check_weights_fit / load_tokenizer / check_init_from   a model directory's weights
                                                                             and tokenizer
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError

from deepseek_zero3.cli import UserError

MODEL_CONFIG_DIR = Path(__file__).resolve().parents[2] / "model_configs"  # the repository's, beside the scripts


# The architectures train.py builds, by model_type. A config must state the fields that shape the model: the
# defaults of transformers' config classes describe other models (LlamaConfig's are Llama-7B's, DeepseekV3Config's
# the 671B's), so a field left out would quietly plan and train a model nobody asked for.
CORE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "max_position_embeddings")  # fmt: skip
ARCHITECTURES = {
    "llama": {"template": "tiny", "class_prefix": "Llama", "fields": CORE_FIELDS},
    # Llama with QK-norm, what a llama config's "qk_norm": true builds (dense_variant) and its export says; its defaults
    # (head_dim 128, 32 key/value heads) are Qwen3-8B's.
    "qwen3": {"template": "tiny-qk-norm", "class_prefix": "Qwen3",
              "fields": CORE_FIELDS + ("num_key_value_heads", "head_dim")},
    "deepseek_v3": {
        "template": "deepseek-v3-tiny",
        "class_prefix": "DeepseekV3",
        # Its default num_key_value_heads (128) and routing (8 groups, top-4 groups, scale 2.5) are the 671B's too.
        "fields": CORE_FIELDS
        + ("num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
           "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
           "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob"),
    },
}  # fmt: skip


def resolve_model_config(name_or_path: str, flag: str = "--model_config") -> Path:
    preset = MODEL_CONFIG_DIR / f"{name_or_path}.json"
    path = Path(name_or_path).expanduser()
    if flag == "--init_from":  # weights are loaded from that directory: a preset name is not one
        refuse_run_directory(name_or_path)
        if not (path / "config.json").is_file():
            raise UserError(f"--init_from {name_or_path} is not a Hugging Face model directory (no config.json)")
        return path / "config.json"
    for candidate in (preset, path, path / "config.json"):
        if candidate.is_file():
            return candidate
    presets = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.json"))
    raise UserError(
        f"--model_config {name_or_path!r} is not a preset ({', '.join(presets)}), a config.json or a model directory"
    )


def read_config_json(path: Path, where: str) -> dict:
    """The JSON object in a config file (a model config, a tokenizer's or a model directory's JSON); a file that is
    not one (unreadable, not UTF-8, empty, torn, a list) is refused by name and position, which json's own error and
    transformers' loaders do not give."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{where}: byte {e.start} is not UTF-8; a config file is UTF-8 JSON: restore or fix it"
        ) from None
    except OSError as e:
        raise UserError(f"{where} cannot be read ({e.strerror}); check its permissions or restore it") from None
    if not text.strip():
        raise UserError(f"{where} is empty; restore it, or write it again")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{where} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno}); fix it there or restore it"
        ) from None
    if not isinstance(d, dict):
        raise UserError(f"{where} holds a JSON {type(d).__name__} where a JSON object belongs; restore or fix it")
    return d


def _bad_value(key: str, value) -> str | None:
    """What a core field's value must be, when it is not that; None when it is fine."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key == "norm_topk_prob":
        return None if isinstance(value, bool) else "true or false"
    if key == "routed_scaling_factor":
        return None if number and value > 0 else "a positive number"
    if key == "q_lora_rank" and value is None:  # no query compression (V2-Lite, the small presets)
        return None
    least = 0 if key in ("n_shared_experts", "first_k_dense_replace") else 1
    if isinstance(value, int) and not isinstance(value, bool) and value >= least:
        return None
    return f"an integer >= {least}" + (" or null" if key == "q_lora_rank" else "")


def check_model_fields(d: dict, where: str) -> None:
    """Refuse, naming the file, the field and the fix, a config dict that does not name a supported model_type, whose
    architectures list disagrees with it, or that lacks a core field of that architecture or gives it a bad value."""
    supported = " or ".join(f'"{t}"' for t in ARCHITECTURES)
    model_type = d.get("model_type")
    if model_type is None:
        guess = "deepseek_v3" if "n_routed_experts" in d or "kv_lora_rank" in d else "llama"
        raise UserError(
            f'{where} has no model_type, so its fields would be read as a Llama\'s; add "model_type": "{guess}" '
            f"(the supported ones are {supported})"
        )
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise UserError(
            f"{where} has model_type {model_type!r}, which train.py does not build; the supported ones are "
            f"{supported} (llama is the DeepSeek LLM architecture): start from a preset in {MODEL_CONFIG_DIR}"
        )
    foreign = [a for a in d.get("architectures") or [] if not str(a).startswith(arch["class_prefix"])]
    if foreign:
        raise UserError(
            f"{where} has model_type {model_type!r} but architectures {foreign}: one of them is wrong; make them agree"
        )
    missing = [k for k in arch["fields"] if k not in d]
    if missing:
        fix = f"add them, e.g. from {MODEL_CONFIG_DIR / (arch['template'] + '.json')}"
        if model_type == "qwen3":  # its preset is a llama config with "qk_norm": true, which has no head_dim to copy
            example = MODEL_CONFIG_DIR / (arch["template"] + ".json")
            fix = f'add them, or write it as a llama config with "qk_norm": true (as {example}): a qwen3 model'
        raise UserError(
            f"{where} lacks {', '.join(missing)}, which a {model_type} model needs (transformers' defaults describe "
            f"another model); {fix}"
        )
    for key in arch["fields"]:
        must = _bad_value(key, d[key])
        if must:
            raise UserError(f"{where} has {key}={json.dumps(d[key])}; it must be {must}")
    if model_type == "qwen3" and d.get("use_sliding_window"):  # eval.py scores such models; train.py does not plan one
        raise UserError(
            f"{where} has use_sliding_window=true; train.py trains, masks documents and plans full attention in every "
            "layer: set it false"
        )
    check_architecture(d, where)


def check_architecture(d: dict, where: str) -> None:
    """Refuse, naming the fields, a config of a supported model_type whose sizes do not fit together. transformers
    checks some of them as a StrictDataclassClassValidationError traceback, the others not at all: the model then
    fails in its first forward pass (a RuntimeError in the plan's timing) or, for the routing, sends tokens to experts
    outside the groups it chose. Fields the dict leaves out take transformers' defaults (eval.py reads any config.json
    of these types); values of the wrong type are left to transformers' own check."""
    from transformers import AutoConfig

    if d.get("model_type") not in ARCHITECTURES:
        return
    v = {**AutoConfig.for_model(d["model_type"]).to_dict(), **{k: x for k, x in d.items() if x is not None}}

    def ints(*keys: str) -> bool:
        return all(isinstance(v.get(k), int) and not isinstance(v.get(k), bool) and v[k] >= 1 for k in keys)

    def divisors(n: int) -> str:
        return ", ".join(str(i) for i in range(1, n + 1) if n % i == 0)

    if d["model_type"] in ("llama", "qwen3"):
        # A Llama's heads share hidden_size (LlamaConfig checks it even with a head_dim); a Qwen3 states its head_dim.
        divides = d["model_type"] == "qwen3" or not ints("hidden_size", "num_attention_heads")
        if not divides and v["hidden_size"] % v["num_attention_heads"]:
            raise UserError(
                f"{where} has num_attention_heads={v['num_attention_heads']}, which does not divide hidden_size="
                f"{v['hidden_size']} (each head takes an equal share of it); pick one of {divisors(v['hidden_size'])}"
            )
        heads = v["num_attention_heads"]
        kv = d.get("num_key_value_heads") or heads  # transformers' default: one per query head
        if ints("num_attention_heads") and isinstance(kv, int) and kv >= 1 and heads % kv:
            raise UserError(
                f"{where} has num_key_value_heads={kv}, which does not divide num_attention_heads={heads} (each "
                f"key/value head serves an equal group of query heads); pick one of {divisors(heads)}"
            )
        head_dim = d.get("head_dim") or (v["hidden_size"] // heads if ints("hidden_size", "num_attention_heads") else 0)
        if isinstance(head_dim, int) and head_dim % 2:
            how = "" if d.get("head_dim") else " (hidden_size / num_attention_heads)"
            raise UserError(
                f"{where} has head_dim={head_dim}{how}, an odd number; rotary position embeddings turn pairs of "
                "dimensions: make it even"
            )
        return
    if ints("num_attention_heads", "num_key_value_heads") and v["num_key_value_heads"] != v["num_attention_heads"]:
        raise UserError(
            f"{where} has num_key_value_heads={v['num_key_value_heads']} and num_attention_heads="
            f"{v['num_attention_heads']}; in a deepseek_v3 model (MLA) every head has its own keys and values from the "
            "compressed latent: set them equal"
        )
    if ints("qk_rope_head_dim") and v["qk_rope_head_dim"] % 2:
        raise UserError(
            f"{where} has qk_rope_head_dim={v['qk_rope_head_dim']}, an odd number; rotary position embeddings turn "
            "pairs of dimensions: make it even"
        )
    if not ints("n_routed_experts", "n_group", "topk_group", "num_experts_per_tok"):
        return
    experts, groups = v["n_routed_experts"], v["n_group"]
    if experts % groups:
        raise UserError(
            f"{where} has n_group={groups}, which does not divide n_routed_experts={experts} (the router splits the "
            f"experts into equal groups); pick one of {divisors(experts)}"
        )
    per_group = experts // groups
    if per_group < 2:  # a group's score is the sum of its two best experts' (DeepSeek-V3's group-limited routing)
        raise UserError(
            f"{where} has n_routed_experts={experts} in n_group={groups} groups: {per_group} expert per group, and "
            "the router scores a group by its two best experts; use at most "
            f"{experts // 2} groups (n_group 1 for no grouping)"
        )
    if v["topk_group"] > groups:
        raise UserError(
            f"{where} has topk_group={v['topk_group']}, more than its n_group={groups} groups; each token chooses "
            f"topk_group of them: lower it to at most {groups}"
        )
    if v["num_experts_per_tok"] > v["topk_group"] * per_group:
        raise UserError(
            f"{where} has num_experts_per_tok={v['num_experts_per_tok']}, more than the "
            f"{v['topk_group'] * per_group} experts of its topk_group={v['topk_group']} group(s) of {per_group}; "
            "each token's experts come from the groups it chose: lower it, or raise topk_group"
        )


def one_line(error: Exception, limit: int = 300) -> str:
    """An exception's message on one line (transformers' validation errors span two: the validator, then why)."""
    return " ".join(str(error).split())[:limit] or type(error).__name__


def dense_variant(d: dict, where: str) -> dict:
    """A checked config dict with train.py's switches resolved into the transformers architecture that has them, so that
    the model trains, exports and loads back (AutoModelForCausalLM) as the same model. "qk_norm": true on a llama config
    (an RMSNorm over each head's query and key before the rotary embedding; OLMo 2, Qwen3, Gemma 3) is transformers'
    Qwen3, which is the Llama architecture with exactly that: its decoder layer, MLP, norms and rotary embedding are
    Llama's, with q_norm and k_norm of head_dim weights in each attention. The Llama config's values, its own defaults
    filling what the file leaves out, carry over, so the model is the Llama with the norms added; Qwen3's sliding
    window stays off. "qk_norm": false (or no key) is the plain Llama. Refused in one line: a qk_norm that is not a
    boolean, one on another architecture (DeepSeek-V3's MLA has no per-head QK-norm in transformers to export it
    as), and what Qwen3 cannot export with it (MLP biases)."""
    from transformers import AutoConfig

    if "qk_norm" not in d:
        return d
    d = dict(d)
    qk_norm = d.pop("qk_norm")
    if d["model_type"] != "llama":
        raise UserError(
            f'{where} has "qk_norm" under model_type {d["model_type"]!r}, whose transformers architecture '
            f"({ARCHITECTURES[d['model_type']]['class_prefix']}) has no QK-norm to export the model with; remove it "
            "(QK-norm is a switch of the dense llama configs, as in model_configs/tiny-qk-norm.json)"
        )
    if not isinstance(qk_norm, bool):
        raise UserError(f'{where} has "qk_norm": {json.dumps(qk_norm)}; it must be true or false')
    if not qk_norm:
        return d
    if d.get("mlp_bias"):
        raise UserError(
            f'{where} has "qk_norm": true and "mlp_bias": true; a llama model with QK-norm is transformers\' Qwen3 '
            "architecture, which has no MLP biases to export them as: set mlp_bias false, or qk_norm false"
        )
    llama = build_model_config(d, where).to_dict()
    qwen3 = set(AutoConfig.for_model("qwen3").to_dict())
    # mlp_bias (false here) and pretraining_tp (unused by transformers 5's Llama) are the Llama's own fields.
    kept = {k: x for k, x in llama.items() if k in qwen3 and k not in ("transformers_version", "architectures")}
    return {**kept, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": False}


def build_model_config(d: dict, where: str):
    """The transformers config of a checked config dict (train.py's switches resolved: dense_variant). Keys its class
    does not define are refused: transformers would keep them as inert attributes, so MoE fields under model_type
    llama, say, would train a dense model."""
    from transformers import AutoConfig

    d = dict(dense_variant(d, where))
    model_type = d.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **d)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:
        raise UserError(f"{where} is refused by transformers: {one_line(e)}; fix that field") from None
    known = set(type(config)().to_dict())
    # A leading _ marks transformers' own bookkeeping (_name_or_path, _attn_implementation_autoset), not a setting.
    ignored = sorted(k for k in config.to_dict() if k not in known and not k.startswith("_"))
    if ignored:
        others = [
            t for t in ARCHITECTURES if t != model_type and set(ignored) <= set(AutoConfig.for_model(t).to_dict())
        ]
        them = "them" if len(ignored) > 1 else "it"
        fix = f'set "model_type": "{others[0]}" or remove {them}' if others else f"remove {them} or fix the spelling"
        raise UserError(
            f"{where} has {', '.join(ignored)}, which a {model_type} model does not use (transformers would ignore "
            f"{them}): {fix}"
        )
    return config


# The layouts of weights transformers reads, in the order it looks for them: (the file, the index's shard format).
WEIGHT_LAYOUTS = (("model.safetensors", None), ("model.safetensors.index.json", ".safetensors"),
                  ("pytorch_model.bin", None), ("pytorch_model.bin.index.json", ".bin"))  # fmt: skip


def check_weight_files(directory: Path, where: str) -> None:
    """Refuse, naming the file, a model directory whose weights transformers would fail on with a traceback or with a
    message that names no file or blames another one, before it or ZeRO-3's loading reads them: no weights in any
    layout it reads (WEIGHT_LAYOUTS), or in the layout it reads a weight file that is empty, truncated or not of its
    format, an index that is not JSON or has no weight_map, names a shard that is not there, or (safetensors, whose
    index says where each tensor is read from) places a tensor in a shard that does not hold it. Reads headers only:
    a safetensors header, the pickle of a .bin's tensors (memory-mapped, never their bytes). Every .safetensors file
    of the directory is checked too (the MTP modules' beside the model)."""
    directory = Path(directory)
    for weights in sorted(directory.glob("*.safetensors")):
        _tensor_names(weights, where)
    layout = next(((name, shard) for name, shard in WEIGHT_LAYOUTS if (directory / name).is_file()), None)
    if layout is None:
        raise UserError(
            f"{where} holds no weights ({', '.join(name for name, _ in WEIGHT_LAYOUTS)} or their shards); copy or "
            "export the model directory again"
        )
    name, shard_format = layout
    if shard_format is None:
        _tensor_names(directory / name, where)
        return
    index = read_config_json(directory / name, f"{where}: {name}")
    weight_map = index.get("weight_map")
    if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
        raise UserError(
            f"{where}: {name} has no weight_map (each tensor's shard file); restore the index saved with the shards"
        )
    for shard in sorted(set(weight_map.values())):
        if not (directory / shard).is_file():
            raise UserError(
                f"{where}: {name} names {shard}, which is missing from the directory; copy the model directory again"
            )
        held = _tensor_names(directory / shard, where)
        misplaced = sorted(t for t, s in weight_map.items() if s == shard and t not in held)
        if misplaced and shard_format == ".safetensors":  # a .bin shard is read whole, whatever its index says
            more = f" (and {len(misplaced) - 1} more)" if len(misplaced) > 1 else ""
            raise UserError(
                f"{where}: {name} places {misplaced[0]}{more} in {shard}, which does not hold it; the index is not "
                "the one saved with these shards: restore it, or copy the model directory again"
            )


def _tensor_names(path: Path, where: str) -> set[str]:
    """The tensor names of one weight file, or a UserError naming it when it is not a whole file of its format."""
    import zipfile

    import torch
    from safetensors import SafetensorError, safe_open

    if path.suffix == ".safetensors":
        try:  # reads the header only, and checks that the tensors it lists fill the file exactly
            with safe_open(path, framework="pt") as f:
                return set(f.keys())
        except (SafetensorError, OSError) as e:
            raise UserError(
                f"{where}: {path.name} is damaged ({e}); copy or export the model directory again"
            ) from None
    try:  # a zip (torch.save's format since 1.6) is memory-mapped: its tensors' bytes are not read
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:  # noqa: BLE001 - EOFError, UnpicklingError, RuntimeError from the zip reader, OSError
        why = one_line(e).split(". ")[0]  # torch's advice after it is about other causes (trust, weights_only)
        raise UserError(
            f"{where}: {path.name} is damaged ({type(e).__name__}{': ' + why if why != type(e).__name__ else ''}); "
            "copy or export the model directory again"
        ) from None
    if not (isinstance(state, dict) and all(isinstance(t, torch.Tensor) for t in state.values())):
        raise UserError(
            f"{where}: {path.name} holds a {type(state).__name__}, not tensors by name (a state dict); copy or "
            "export the model directory again"
        )
    return set(state)


def _no_load_report(record: logging.LogRecord) -> bool:
    return "LOAD REPORT" not in record.getMessage()


@contextlib.contextmanager
def quiet_load_report():
    """Loading without transformers' table of missing, unexpected and mismatched tensors (its "LOAD REPORT"
    warning): check_weights_match_config refuses them in one line, and the table before it is noise."""
    log = logging.getLogger("transformers.modeling_utils")
    log.addFilter(_no_load_report)
    try:
        yield
    finally:
        log.removeFilter(_no_load_report)


def check_weights_match_config(where: str, directory: Path, loading: dict, config_file: str = "config.json") -> None:
    """Refuse a model whose weights and config (or the index that says where each tensor is) disagree, from
    transformers' loading info (output_loading_info=True, ignore_mismatched_sizes=True): it would initialise what is
    missing or of another shape at random and drop what the config has no place for, and the model would be
    another one."""
    problems = [
        f"{len(keys)} {what} (e.g. {', '.join(str(k) for k in sorted(keys)[:2])})"
        for keys, what in (
            (loading["missing_keys"], "tensors missing from the weights"),
            ([k for k, *_ in loading["mismatched_keys"]], "tensors of another shape than the config says"),
            (loading["unexpected_keys"], "tensors the config has no place for"),
        )
        if keys
    ]
    if problems:
        index = [n for n, shards in WEIGHT_LAYOUTS if shards and (Path(directory) / n).is_file()][:1]
        saved = " and ".join([config_file, *index])
        raise UserError(
            f"{where}: its {config_file} and its weights do not belong together: {'; '.join(problems)}; "
            f"restore the {saved} saved with the weights"
        )


def load_model_config(model_config: str, init_from: str, seq_len: int, meta: dict | None):
    """The model's transformers config, with the vocabulary taken from the data's tokenizer (padded to 64)."""
    flag = "--init_from" if init_from else "--model_config"
    path = resolve_model_config(init_from or model_config, flag)
    where = f"{flag} {path}"
    d = read_config_json(path, where)
    check_model_fields(d, where)
    config = build_model_config(d, where)
    if init_from and "qk_norm" in d:  # from_pretrained reads its weights as the model_type's, which has no such key
        raise UserError(
            f'{where} has "qk_norm", a switch of train.py\'s --model_config files that transformers does not read: '
            'its weights load as a plain llama; remove the key (an export with QK-norm says "model_type": "qwen3")'
        )
    if init_from:
        if meta is not None and config.vocab_size < meta["vocab_size"]:
            raise UserError(
                f"--init_from {init_from} has vocab_size {config.vocab_size} < the data's "
                f"{meta['vocab_size']}; prepare the data with that model's tokenizer"
            )
    elif meta is not None:  # without data (planning) the preset keeps its own vocabulary
        config.vocab_size = round_up(meta["vocab_size"], 64)
        config.bos_token_id = config.eos_token_id = meta["eos_id"]
        config.pad_token_id = None
    if seq_len > config.max_position_embeddings:
        raise UserError(
            f"--seq_len {seq_len} exceeds the model's context max_position_embeddings="
            f"{config.max_position_embeddings}; lower --seq_len or use a config with a longer context"
        )
    return config


def architecture(model_config) -> dict:
    """A model config without names and versions: what makes two configs the same model."""
    d = model_config.to_diff_dict() if hasattr(model_config, "to_diff_dict") else dict(model_config)
    ignored = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures")
    return {k: v for k, v in d.items() if k not in ignored}


def config_differences(ours, theirs) -> str:
    """The fields in which two model configs differ, as `field ours -> theirs` (a nested dict's, such as
    rope_parameters, by its own keys); "" when they are the same model."""

    def flat(d: dict) -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):  # rope_parameters' keys by their own names: rope_theta as config files spell it
                out.update({j if k == "rope_parameters" else f"{k}.{j}": w for j, w in v.items()})
            else:
                out[k] = v
        return out

    a, b = flat(architecture(ours)), flat(architecture(theirs))
    return ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def check_model_unchanged(cfg, flags_given: set[str], saved_config, meta: dict, say) -> None:
    """A resumed run's model is its checkpoint's model_config.json. The model the run was started from (--model_config,
    or --init_from's config.json) may have been edited since: given again on this command, it must still be that
    model (refused, naming the fields that differ); not given, the run goes on with the checkpoint's model and `say`
    gives a note (a preset edited for other runs must not stop this one). One that no longer reads (a deleted
    --init_from directory) is noted likewise."""
    flag, name = ("--init_from", cfg.init_from) if cfg.init_from else ("--model_config", cfg.model_config)
    try:
        named = load_model_config(cfg.model_config, cfg.init_from, cfg.seq_len, meta)
    except UserError as e:
        say(f"note: {flag} {name} does not read now ({e}); the run continues with its checkpoint's model_config.json")
        return
    differences = config_differences(saved_config, named)
    if not differences:
        return
    if flags_given & {"model_config", "init_from"}:
        raise UserError(
            f"cannot resume: {flag} {name} builds another model than the checkpoint's model_config.json "
            f"({differences}: the checkpoint's -> this file's); drop {flag} to continue the run's model, or start a "
            "new --output_dir for the edited one"
        )
    say(f"note: {flag} {name} has changed since the run started ({differences}); the run continues with the model "
        "of its checkpoint's model_config.json (the change applies to new runs)")  # fmt: skip


# The weights that write into the residual stream: attention's output projection and the MLP's, a dense layer's, a
# shared expert's (nn.Linear) and the routed experts' (one [experts, hidden, intermediate] parameter).
RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")


def scale_residual_init(model, within: str = ""):
    """Draw the weights that write into the residual stream again, with std initializer_range / sqrt(2 x layers):
    each layer adds two such outputs to the residual stream, which the scale keeps from growing with depth (GPT-2's
    and Megatron-LM's scaled init, OPT's). transformers draws every weight with std initializer_range; DeepSeek's
    papers state one std (0.006) for all parameters, DeepSeek-V3's released config initializer_range 0.02. Measured with
    bench/vs_nanogpt.py (`mini`, 300 steps of 16 x 128 tokens, seed 0): validation loss at peak LR 1e-3 / 2e-3 5.423 /
    5.444 before (commit 2895f3a), 5.089 / 5.084 with it; nanoGPT, which scales the same way, 5.381 / 5.328.
    Under ZeRO-3 (zero.Init: each rank holds a shard) each weight is gathered whole, drawn on rank 0 and scattered
    back, as transformers' initialize_weights_zero3 draws the others. `within`: only the weights under that name prefix
    (mtp.attach's modules, built after the model's own were drawn). Returns the model."""
    import torch

    std = model.config.initializer_range / math.sqrt(2 * model.config.num_hidden_layers)
    weights = [p for name, p in model.named_parameters() if name.endswith(RESIDUAL_OUTPUTS) and name.startswith(within)]
    for weight in weights:
        if hasattr(weight, "ds_id"):  # partitioned by zero.Init
            import deepspeed

            with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
                if deepspeed.comm.get_rank() == 0:
                    torch.nn.init.normal_(weight, mean=0.0, std=std)
        else:
            torch.nn.init.normal_(weight, mean=0.0, std=std)
    return model


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def load_tokenizer(directory: Path, fix: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # noqa: BLE001 - a missing, torn or foreign tokenizer file: many exception types
        raise UserError(f"{directory} holds no readable tokenizer ({type(e).__name__}); {fix}") from None


def check_weights_fit(model_dir: str) -> None:
    """--init_from's tensors are the ones its config.json builds, by transformers' own loading (its renames of older
    layouts included) onto the meta device: names and shapes from the files' headers, no weights read. Unchecked, a
    foreign tensor set started a run from random weights with a warning. Call it with ZeRO-3's zero.Init off (train.py:
    distributed.without_zero3_init), which would partition the meta model."""
    from transformers import AutoModelForCausalLM

    try:
        with quiet_load_report():
            _, loading = AutoModelForCausalLM.from_pretrained(
                model_dir, device_map="meta", output_loading_info=True, ignore_mismatched_sizes=True
            )
    except (OSError, ValueError, TypeError, KeyError, StrictDataclassError) as e:
        raise UserError(f"--init_from {model_dir}: cannot be loaded ({one_line(e)})") from None
    check_weights_match_config(f"--init_from {model_dir}", Path(model_dir), loading)


def refuse_run_directory(model_dir: str) -> None:
    """--init_from names a train.py run directory (its config.json holds the run's settings, not a model's)."""
    if (Path(model_dir) / "train_run.json").is_file():  # checkpoint.MARKER: a run directory, not its model
        raise UserError(
            f"--init_from {model_dir} is a train.py run directory; pass the model it exported, --init_from "
            f"{Path(model_dir) / 'final'}"
            + ("" if (Path(model_dir) / "final").is_dir() else " (once the run finishes)")
        )


def check_init_from(model_dir: str, ours, data_eos_id: int) -> None:
    """--init_from must be a model directory with whole weight files that fit its config, trained on the ids the data
    holds (tokenizer_difference; ours: the data's tokenizer)."""
    refuse_run_directory(model_dir)
    if not (Path(model_dir) / "config.json").is_file():
        raise UserError(f"--init_from {model_dir} is not a Hugging Face model directory (no config.json)")
    check_weight_files(Path(model_dir), f"--init_from {model_dir}")
    check_weights_fit(model_dir)
    theirs = load_tokenizer(
        Path(model_dir), "nothing shows --init_from was trained on the data's ids: copy its tokenizer into it"
    )
    difference = tokenizer_difference(theirs, ours, data_eos_id)
    if difference:
        raise UserError(
            f"--init_from {model_dir} was trained with another tokenizer than the data's ({difference}); prepare the "
            f"data with prepare_data.py --tokenizer {model_dir}"
        )


def tokenizer_difference(model_tokenizer, data_tokenizer, data_eos_id: int) -> str | None:
    """How a model's tokenizer differs from the one a prepared directory's ids come from (None: it does not): the
    vocabulary (token -> id), the encoding of a probe text, the EOS id. A vocabulary size alone says nothing (two
    512-token BPEs agree)."""
    probe = "The tokenizer probe: naïve café, 1234 + x**2\n\n\tdef f(): return 'ok'"
    if model_tokenizer.get_vocab() != data_tokenizer.get_vocab():
        return f"other vocabularies: the model's {len(model_tokenizer)} tokens, the data's {len(data_tokenizer)}"
    if model_tokenizer.encode(probe) != data_tokenizer.encode(probe):
        return "encodings differ"
    if model_tokenizer.eos_token_id != data_eos_id:
        return f"EOS id {model_tokenizer.eos_token_id}, the data's {data_eos_id}"
    return None
