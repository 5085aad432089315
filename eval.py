"""Corpus perplexity of any causal LM (on WikiText, the numbers of lm-evaluation-harness's `wikitext` task), and
downstream tasks (HellaSwag, ARC, ...) through lm-evaluation-harness itself; of an exported model or a checkpoint.

    python eval.py --model runs/tiny/final --dataset path/to/wikitext-2 --split test     # local wiki.test.raw
    python eval.py --model runs/tiny/final --dataset data/python-docs --split validation # a prepare_data.py directory
    python eval.py --model gpt2 --dataset wikitext-2 --max_length 1024 --stride 512      # online, Hub data and model
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 eval.py --model runs/tiny/final     # over 2 CPU processes
    accelerate launch --num_processes 3 eval.py --model runs/1.3b/final                  # documents split over 3 GPUs
    python eval.py --model runs/1.3b/final --tasks core --batch_size 32                  # the harness's core tasks
    python eval.py --model runs/1.3b/checkpoints/step_500 --tasks core --dataset wikitext-2  # a checkpoint, both
    python eval.py --model runs/1.3b --tasks my_task --include_path my_tasks/            # newest intact checkpoint
    python eval.py --model runs/1.3b --prompt "The history of" --seed 1 --max_new_tokens 40  # what it writes

--model is a Hugging Face model directory (or Hub id), a train.py checkpoint (OUT/checkpoints/step_N: its ZeRO-3
shards consolidated in memory by DeepSpeed, nothing written), or a run directory OUT (its newest intact checkpoint).
--tasks runs lm-evaluation-harness's own tasks through its Python API and its HF model class on that model: the
numbers of `lm_eval --model hf` on the same model, dtype and batch size. Without --tasks the perplexity is of
--dataset (default wikitext-2); with --tasks, perplexity is added only when --dataset is given.
--prompt (or --prompt_file) continues text with transformers' generate (deepseek_zero3/evaluation/generate.py) instead
of scoring, unless --dataset or --tasks is given too.

WikiText (the Hub presets, local wiki.*.raw files) is scored as the harness scores it: the pages of
EleutherAI/wikitext_document_level (a local file is split into exactly those pages), each page passed through the
harness's own wikitext_detokenizer, words and bytes counted on the page before detokenizing (--raw_text scores the
pages as they are). Other text is scored as it is.
Each document is scored on its own: its tokens in windows of --max_length, every token exactly once, the first one
conditioned on the BOS (or EOS) token; --stride below --max_length gives each window extra, unscored left context.
Reported: total NLL (nats), token perplexity exp(NLL / tokens), word perplexity exp(NLL / words), byte perplexity
exp(NLL / bytes) and bits per byte NLL / (bytes ln 2), with words = len(re.split(r"\\s+", doc)) and bytes the UTF-8
length of the original document text.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

from deepseek_zero3 import cli, distributed
from deepseek_zero3.cli import UserError, field, write_json_atomic
from deepseek_zero3.evaluation import generate, harness_tasks
from deepseek_zero3.model import models, mtp
from deepseek_zero3.model.lmloss import make_windows, score_windows, validation_loss
from deepseek_zero3.prepare import corpora, documents
from deepseek_zero3.run_dir import card, checkpoint, metrics, run_model
from deepseek_zero3.training_data import token_data


# fmt: off
@dataclasses.dataclass
class Config:
    model: str = field("", "causal LM directory (or Hub id, online) that AutoModelForCausalLM loads, a train.py "
                           "checkpoint OUT/checkpoints/step_N, or a run directory OUT (its newest intact checkpoint)")
    tokenizer: str = field("", "tokenizer directory or Hub id (default: the model's; a checkpoint's: its run's)")
    dataset: str = field("", "perplexity on: wikitext-2 | wikitext-103 (Hub), a prepare_data.py directory, or a "
                             "local file/directory (wiki.test.raw layout, .txt blocks, .jsonl); default wikitext-2, "
                             "none with --tasks")
    split: str = field("test", "split to score: test | validation | train")
    text_field: str = field("text", "text field of .jsonl/.parquet records")
    max_length: int = field(0, "tokens per window (0: the model's context)")
    stride: int = field(0, "new tokens scored per window (0: --max_length, no overlap)")
    batch_size: int = field(4, "windows per forward pass (4 is fastest on CPUs; raise it on a GPU); for --tasks, "
                               "the harness's --batch_size")
    max_documents: int = field(0, "score only the first N documents (0: all)")
    dtype: str = field("auto", "float32 | bfloat16 | float16 | auto (bf16 on GPUs that have it, else fp32)")
    device: str = field("", "cuda | cpu (default: CUDA when present); under accelerate launch, the process's device")
    output_json: str = field("", "write the report here as JSON")
    update_card: bool = field(False, "add the scores to the model card (README.md) that train.py wrote into --model")
    raw_text: bool = field(False, "score WikiText pages as they are, not through lm-evaluation-harness's "
                                  "wikitext_detokenizer")
    packed_seq_len: int = field(0, "with a prepare_data.py directory: score its validation tokens as train.py "
                                   "validates them, in packed windows of this many tokens: its val_loss and val_bpb")
    eval_tokens: int = field(0, "with --packed_seq_len: validation tokens of each source (0: all; train.py's flag)")
    data_mix: str = field("", "with --packed_seq_len: the run's --data_mix, so val_loss weighs the sources as it did")
    document_masking: bool = field(True, "with --packed_seq_len: each document of a window attends only to itself, "
                                         "as in train.py (--no_document_masking: the whole window)")
    # downstream tasks (lm-evaluation-harness)
    tasks: str = field("", "comma-separated lm-evaluation-harness tasks, groups or tags; `core` = "
                           f"{','.join(harness_tasks.CORE_TASKS)} (their Hub datasets, cached once)")
    include_path: str = field("", "directory of task YAML files of your own (the harness's --include_path)")
    num_fewshot: int = field(-1, "examples in each task's context (-1: the task's own setting)")
    limit: float = field(0, "score only the first N examples of each task (below 1: that fraction; 0: all)")
    # generation: what the model writes (instead of scores, unless --dataset or --tasks is given too)
    prompt: list[str] = dataclasses.field(default_factory=list, metadata={"action": "append", "help":
                        "continue this text with the model (repeatable); prints the continuations, no scores unless "
                        "--dataset or --tasks asks for them too"})
    prompt_file: str = field("", "continue each prompt of this text file: one per blank-line-separated block")
    max_new_tokens: int = field(64, "with --prompt: tokens to write after each prompt at most (the model's EOS token "
                                    "ends a continuation earlier)")
    temperature: float = field(0.8, "with --prompt: sampling temperature (0: greedy, the most likely token each time)")
    top_k: int = field(0, "with --prompt: sample among the k most likely tokens only (0: off)")
    top_p: float = field(1.0, "with --prompt: sample within the smallest set of tokens of this much probability "
                              "(nucleus sampling; 1: off)")
    seed: int = field(0, "with --prompt: the random seed of each prompt's sampling (the same seed, the same text)")
# fmt: on


# lm-evaluation-harness's `wikitext` task: its dataset (one row per page) and the text transform it scores.
HARNESS_WIKITEXT = "EleutherAI/wikitext_document_level"
HARNESS_TRANSFORM = "lm-eval wikitext_detokenizer"
# The JSON files of a model or tokenizer directory that loading reads. transformers' errors on a damaged one name
# neither the file nor the position (a torn tokenizer.json) or are tracebacks (a config.json holding a list).
MODEL_JSON_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "added_tokens.json")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------------------------------


def perplexity_report(nll: float, tokens: int, words: int, n_bytes: int, documents: int) -> dict:
    """The totals and the perplexities per token, word and byte. A perplexity past the float range (exp of a mean NLL
    over 709.78 nats: text with few words, such as Chinese, which has no spaces) is None, with a note in "notes" that
    gives its exponent, so the totals are never lost to an OverflowError."""
    report = {"documents": documents, "tokens": tokens, "words": words, "bytes": n_bytes, "nll": nll}
    notes = []
    for unit, count in (("token", tokens), ("word", words), ("byte", n_bytes)):
        try:
            report[f"{unit}_perplexity"] = math.exp(nll / count)
        except OverflowError:
            report[f"{unit}_perplexity"] = None
            notes.append(f"{unit}_perplexity: exp(NLL / {unit}s) = exp({nll / count:.6g}) is past the float range; "
                         f"null here (the text has {count:,} {unit}s for an NLL of {nll:.6g} nats)")  # fmt: skip
    report["bits_per_byte"] = nll / (n_bytes * math.log(2))
    return report | ({"notes": notes} if notes else {})


def check_finite(report: dict, model, dtype: torch.dtype) -> None:
    """Refuse a NaN or infinite loss, which was reported as a score with exit 0 (and written into the model card as an
    empty table), saying why: float16's range (65504) overflowed, or the weights themselves are not finite."""
    loss = report.get("nll", report.get("val_loss"))
    if loss is None or math.isfinite(loss):
        return
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if dtype == torch.float16:
        why = "the model's activations overflow float16's range (65504" + ("; so do its weights" if bad else "") + \
              "), as those of a model trained in bfloat16 or float32 can: score it with --dtype bfloat16 or float32"
    elif bad:
        why = f"the model's weights are not finite ({len(bad)} tensors, e.g. {bad[0]}), a diverged run's: score an " \
              "earlier checkpoint"
    elif dtype != torch.float32:
        why = f"the model's activations overflow {str(dtype).replace('torch.', '')}: score it with --dtype float32"
    else:
        why = "the model's outputs are not finite: score an earlier checkpoint"
    raise UserError(f"the NLL is {loss} in {str(dtype).replace('torch.', '')}: {why}; nothing was written")


def word_count(doc: str) -> int:
    return len(re.split(r"\s+", doc))


# ---------------------------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------------------------


def harness_detokenizer():
    """lm-evaluation-harness's own `wikitext_detokenizer`, used rather than rewritten so the text scored is the
    harness's by construction. Its file is loaded on its own: importing it through lm_eval.tasks would first build
    the harness's task registry (1.4 s, a fortieth of scoring WikiText-2 on a CPU)."""
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    source = (
        Path(spec.origin).parent / "tasks" / "wikitext" / "preprocess_wikitext.py" if spec and spec.origin else None
    )
    if source is None or not source.is_file():
        raise UserError(
            "scoring WikiText as lm-evaluation-harness does needs its detokenizer: pip install lm-eval==0.4.13 "
            "(requirements.txt has it), or pass --raw_text to score the raw pages"
        )
    module_spec = importlib.util.spec_from_file_location("lm_eval_preprocess_wikitext", source)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return lambda page: module.wikitext_detokenizer({"page": page})


def hub_wikitext_pages(cfg: Config) -> list[str]:
    """The pages of the harness's own WikiText dataset, for --dataset wikitext-2 / wikitext-103."""
    from datasets import load_dataset

    dsd = corpora.from_hub(
        f"--dataset {cfg.dataset}",
        lambda: load_dataset(HARNESS_WIKITEXT, corpora.HUB_PRESETS[cfg.dataset].config),
        "pass a local copy instead (a directory with wiki.test.raw, or the file itself): its pages are split exactly "
        "as the Hub's",
    )
    if cfg.split not in dsd:
        raise UserError(
            f"--dataset {cfg.dataset} has no '{cfg.split}' split (it has {sorted(dsd)}); pick one with --split"
        )
    return list(dsd[cfg.split]["page"])


def local_documents(cfg: Config) -> tuple[list[str], bool]:
    """Documents of local files for one split, and whether they are WikiText pages: a wiki.*.raw layout, or text with
    WikiText's ` = Title = ` lines, is split into the harness's pages; other text into blank-line-separated blocks."""
    files, layout = corpora.resolve_local_files(cfg.dataset)
    if cfg.split not in files:
        if len(files) == 1 and "train" in files and Path(cfg.dataset).expanduser().is_file():
            files = {cfg.split: files["train"]}  # a single file is whatever split the user says it is
        else:
            raise UserError(
                f"--dataset {cfg.dataset} has no '{cfg.split}' split (it has {sorted(files)}); pick one with --split"
            )
    docs, wikitext = [], False
    for path in files[cfg.split]:
        if path.suffix not in documents.TEXT_SUFFIXES:
            docs.extend(documents.file_documents(path, cfg.text_field, "blank_line", documents.SourceStats()))
            continue
        text, _ = documents.read_text(path)
        if documents.is_wikitext(text):
            docs.extend(documents.harness_wikitext_pages(text))
            wikitext = True
        elif layout == "wikitext" or documents.is_wikitext_file(path):
            raise UserError(
                f"{path} is named like a WikiText file but has no article title line (' = Title = '); "
                f"it would be scored as one giant page: check the file, or rename it to score it as plain text"
            )
        else:
            docs.extend(documents.split_blank_line_blocks(text))
    return docs, wikitext


def load_documents(cfg: Config) -> tuple[list[str], list[str], str]:
    """(documents as stored, the texts scored, the transform between them). WikiText is scored as
    lm-evaluation-harness scores it: its pages through its detokenizer (--raw_text: the pages as they are)."""
    path = Path(cfg.dataset).expanduser()
    wikitext = False
    if (path / "meta.json").is_file():  # a prepare_data.py directory keeps its held-out text as .jsonl
        held = path / f"{cfg.split}.jsonl"
        if not held.is_file():
            raise UserError(
                f"{cfg.dataset} has no {cfg.split}.jsonl (prepare_data.py keeps the text of validation and test splits)"
            )
        docs = list(documents.jsonl_documents(held, "text", documents.SourceStats()))
    elif cfg.dataset in ("wikitext-2", "wikitext-103"):
        docs, wikitext = hub_wikitext_pages(cfg), True
    elif cfg.dataset in corpora.HUB_PRESETS or cfg.dataset in corpora.BUILTIN_SOURCES:
        source = corpora.open_source(cfg.dataset, cfg.text_field, "blank_line")
        if cfg.split not in source.splits:
            raise UserError(
                f"--dataset {cfg.dataset} has no '{cfg.split}' split (it has {sorted(source.splits)}); pick one with "
                "--split"
            )
        docs = list(itertools.islice((d for d in source.splits[cfg.split]() if d.strip()), cfg.max_documents or None))
    else:
        docs, wikitext = local_documents(cfg)
    docs = [d for d in docs if d.strip()]
    docs = docs[: cfg.max_documents] if cfg.max_documents else docs
    if not docs:
        raise UserError(f"--dataset {cfg.dataset} --split {cfg.split} holds no documents; point it at text")
    if wikitext and not cfg.raw_text:
        detokenize = harness_detokenizer()
        return docs, [detokenize(d) for d in docs], HARNESS_TRANSFORM
    return docs, docs, "none"


def check_model_files(flag: str, name: str) -> None:
    """Refuse a local model or tokenizer directory that is missing or holds a damaged file, naming the file, before
    transformers reads it. A Hub id (no such directory) passes, when the Hub can be reached."""
    path = Path(name).expanduser()
    if not path.exists():
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(name)
        except HFValidationError:
            raise UserError(f"{flag} {name}: no such directory, and not a Hub id (org/name) either") from None
        variable = corpora.offline_variable()
        wanted = "config.json" if flag == "--model" else "tokenizer_config.json"
        if variable and not isinstance(try_to_load_from_cache(name, wanted), str):
            raise UserError(
                f"{flag} {name} is not a local directory, and {variable}={os.environ[variable]} (offline mode) with "
                f"no copy of it in the local Hugging Face cache; pass a local directory, or run once without "
                f"{variable} where the Hub is reachable"
            )
        offline = corpora.hub_unreachable_reason() if not variable else None
        if offline:
            raise UserError(f"{flag} {name} is not a local directory and {offline}")
        return
    if flag == "--model" and not (path / "config.json").is_file():
        raise UserError(
            f"--model {name} is not a model directory (no config.json); pass e.g. the OUT/final directory that "
            "train.py writes"
        )
    if not path.is_dir():
        raise UserError(f"{flag} {name} is a file; pass the directory that holds it")
    for json_name in MODEL_JSON_FILES:
        if (path / json_name).is_file():
            models.read_config_json(path / json_name, f"{flag} {name}: {json_name}")
    if flag != "--model":
        return
    check_model_config(path, f"--model {name}: config.json")
    models.check_weight_files(path, f"--model {name}")


def check_model_config(path: Path, where: str) -> None:
    """A model directory's config.json as transformers reads it, refused in one line where its sizes do not fit
    together (models.check_architecture, for the types train.py builds) or transformers' validation refuses it (its
    error is a traceback, and the tokenizer's loading, which reads the config too, would be blamed)."""
    from transformers import AutoConfig

    models.check_architecture(models.read_config_json(path / "config.json", where), where)
    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError, StrictDataclassError) as e:
        raise UserError(f"{where} is refused by transformers: {models.one_line(e)}; fix that field") from None


def model_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.dtype)
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if dtype is None:
        raise UserError(f"--dtype {cfg.dtype} must be one of float32, bfloat16, float16, auto")
    return dtype


def load_tokenizer(cfg: Config, ckpt: run_model.RunCheckpoint | None):
    """--tokenizer, else the model directory's, else (a checkpoint) the tokenizer of the run's data."""
    from transformers import AutoTokenizer

    if cfg.tokenizer:  # its files were checked by evaluate
        flag, name = "--tokenizer", cfg.tokenizer
    elif ckpt is not None:
        flag, name = f"--model {cfg.model}: the run's tokenizer", str(ckpt.tokenizer_dir)
    else:
        flag, name = "--model", cfg.model
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception on a torn tokenizer.json
        raise UserError(
            f"{flag} {name}: its tokenizer cannot be loaded ({str(e).splitlines()[0]}); "
            f"pass a working one with --tokenizer (e.g. the tokenizer/ of the data directory the model was trained on)"
        ) from None


def load_model(cfg: Config, device: torch.device, ckpt: run_model.RunCheckpoint | None, tokenizer):
    """The model, its tokenizer (load_tokenizer's) and the token the first scored token is conditioned on (their
    files checked by evaluate). A checkpoint's model is built from its ZeRO-3 shards in memory (run_model); any other
    --model is loaded by from_pretrained."""
    from transformers import AutoModelForCausalLM

    dtype = model_dtype(cfg, device)
    try:
        with models.quiet_load_report():  # what it reports is refused below in one line
            if ckpt is not None:
                model, loading = run_model.consolidated_model(ckpt, dtype)
            else:
                model, loading = AutoModelForCausalLM.from_pretrained(
                    cfg.model, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
                )
    except (OSError, ValueError, TypeError, StrictDataclassError) as e:
        raise UserError(f"--model {cfg.model}: cannot be loaded ({str(e).splitlines()[0]})") from None
    config_file = "model_config.json" if ckpt is not None else "config.json"
    models.check_weights_match_config(f"--model {cfg.model}", Path(cfg.model), loading, config_file)
    if len(tokenizer) > model.config.vocab_size:
        raise UserError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {model.config.vocab_size}; "
            f"they do not belong together: pass the model's own tokenizer with --tokenizer"
        )
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if prefix is None:
        raise UserError(
            f"the tokenizer of {cfg.model} has neither a BOS nor an EOS token to condition the first token on"
        )
    return model.to(device).eval(), tokenizer, prefix


def score_perplexity(cfg: Config, state, loaded: tuple, documents: tuple) -> dict:
    """The perplexity report of the documents (load_documents' triple) under the model (load_model's triple), the
    documents split over the processes."""
    model, tokenizer, prefix = loaded
    docs, texts, transform = documents
    device = torch.device(cfg.device) if cfg.device else state.device
    context = model.config.max_position_embeddings
    max_length = cfg.max_length or context
    stride = cfg.stride or max_length
    if max_length > context:
        raise UserError(f"--max_length {max_length} exceeds the model's context of {context} tokens; lower it")
    if not 1 <= stride <= max_length:
        raise UserError(f"--stride {stride} must be between 1 and --max_length {max_length}")

    t0 = time.perf_counter()
    with state.split_between_processes(texts) as my_texts:
        windows = make_windows(my_texts, tokenizer, prefix, max_length, stride)
        nll, n_tokens = score_windows(model, windows, cfg.batch_size, device, prefix, progress=state.is_main_process)
    if state.num_processes > 1:
        totals = torch.stack([nll, n_tokens]).to(state.device)
        torch.distributed.all_reduce(totals)
        nll, n_tokens = totals[0], totals[1]
    seconds = time.perf_counter() - t0
    report = perplexity_report(
        float(nll),
        int(n_tokens),
        sum(word_count(d) for d in docs),
        sum(len(d.encode("utf-8")) for d in docs),
        len(docs),
    )
    report.update(
        dataset=cfg.dataset,
        split=cfg.split,
        text_transform=transform,
        max_length=max_length,
        stride=stride,
        seconds=seconds,
        tokens_per_s=report["tokens"] / seconds,
    )
    return report


def packed_data(cfg: Config, state) -> token_data.TrainingData:
    try:
        data = token_data.training_data(cfg.dataset, cfg.packed_seq_len, cfg.eval_tokens, cfg.data_mix)
    except UserError as e:  # worded for train.py, whose flag is --seq_len
        raise UserError(str(e).replace("--seq_len", "--packed_seq_len")) from None
    for note in data.notes if state.is_main_process else ():
        print(note, file=sys.stderr)
    return data


def check_packed_tokenizer(cfg: Config, tokenizer, data: token_data.TrainingData) -> None:
    """The token ids of --packed_seq_len's directory mean to the model what they meant to the data's tokenizer (the
    text path tokenizes with the model's own; train.py --init_from checks the same): another 512-token BPE's ids gave
    a val_bpb of other text, a larger vocabulary's an IndexError in the embedding."""
    ours = models.load_tokenizer(data.tokenizer_dir, "rebuild the data with prepare_data.py --overwrite")
    difference = models.tokenizer_difference(tokenizer, ours, data.meta["eos_id"])
    if difference:
        raise UserError(
            f"--dataset {cfg.dataset} was tokenized with another tokenizer than the model's ({difference}), so its "
            "ids are other text to this model: score the data the model was trained on, or its text with the model's "
            "own tokenizer (drop --packed_seq_len)"
        )


def score_packed(cfg: Config, state, model, data: token_data.TrainingData) -> dict:
    """train.py's validation of the prepared directory --dataset (the same windows, document masking and weights of
    its sources, --data_mix as the run's; data: packed_data): the val_loss and val_bpb (and per source) that train.py
    logs for these weights."""
    eos = data.meta["eos_id"] if cfg.document_masking else None
    if cfg.packed_seq_len > model.config.max_position_embeddings:
        raise UserError(f"--packed_seq_len {cfg.packed_seq_len} exceeds the model's context of "
                        f"{model.config.max_position_embeddings} tokens; use the run's --seq_len")  # fmt: skip
    t0 = time.perf_counter()
    losses = {
        s.name: validation_loss(model, state, s.val_tokens, cfg.packed_seq_len, cfg.batch_size, eos_id=eos)
        for s in data.sources
        if token_data.num_windows(len(s.val_tokens), cfg.packed_seq_len)
    }
    model.eval()  # validation_loss hands the model back in training mode, as train.py needs it
    report = metrics.validation_metrics(data.sources, data.weights, losses)
    windows = sum(token_data.num_windows(len(s.val_tokens), cfg.packed_seq_len) for s in data.sources)
    report.update(dataset=cfg.dataset, split="validation", packed_seq_len=cfg.packed_seq_len, windows=windows,
                  eval_tokens=cfg.eval_tokens, document_masking=cfg.document_masking, data_mix=cfg.data_mix,
                  seconds=time.perf_counter() - t0)  # fmt: skip
    return report


def task_settings(cfg: Config, num_processes: int) -> harness_tasks.TaskSettings | None:
    if not cfg.tasks:
        if cfg.include_path or cfg.num_fewshot != -1 or cfg.limit:
            raise UserError("--include_path, --num_fewshot and --limit choose how --tasks run; name the tasks too")
        return None
    if num_processes > 1:
        raise UserError(
            f"--tasks runs in one process, this launch has {num_processes} (the harness's HF model class splits "
            "work over processes only for a model it loads itself); run eval.py with python, not torchrun or "
            "accelerate launch"
        )
    if cfg.num_fewshot < -1 or cfg.limit < 0:
        raise UserError(
            f"--num_fewshot {cfg.num_fewshot} / --limit {cfg.limit}: --num_fewshot must be -1 (the task's own) or "
            f"0 and up, --limit 0 and up (0: all examples; below 1: a fraction of them)"
        )
    return harness_tasks.TaskSettings(
        harness_tasks.task_names(cfg.tasks), cfg.include_path, cfg.num_fewshot, cfg.limit, cfg.batch_size
    )


def evaluate(cfg: Config) -> dict:
    """The report: perplexity on --dataset and/or the harness's --tasks, and/or the continuations of --prompt, of the
    model --model names. Everything that can be refused (flags, documents, prompts, task names and their datasets, a
    checkpoint) is, before the model is built."""
    from accelerate import PartialState

    # On CPUs the process group must be asked for (cpu=True): without it torchrun's processes each score everything.
    state = PartialState(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    device = torch.device(cfg.device) if cfg.device else state.device
    check_flags(cfg)
    prompts, sampling = prompt_texts(cfg)
    settings = task_settings(cfg, state.num_processes)
    verb = "generating" if prompts and not (cfg.dataset or settings) else "scoring"
    say_device(cfg, state, device, model_dtype(cfg, device), verb)
    cfg = dataclasses.replace(cfg, dataset=cfg.dataset or ("" if settings or prompts else "wikitext-2"))
    ckpt = run_model.find_checkpoint(cfg.model, cfg.tokenizer)
    if ckpt is None:  # the model and tokenizer files, before the documents are read (they can take minutes)
        check_model_files("--model", cfg.model)
    if cfg.tokenizer:
        check_model_files("--tokenizer", cfg.tokenizer)
    docs = load_documents(cfg) if cfg.dataset and not cfg.packed_seq_len else None
    # read (and refused) before the model is built
    packed = packed_data(cfg, state) if cfg.packed_seq_len else None
    tasks = harness_tasks.load_tasks(settings) if settings else None
    tokenizer = load_tokenizer(cfg, ckpt)
    if packed is not None:
        check_packed_tokenizer(cfg, tokenizer, packed)
    prompt_ids = checked_prompts(cfg, ckpt, tokenizer, prompts, sampling)
    model, tokenizer, prefix = load_model(cfg, device, ckpt, tokenizer)
    report = {"model": cfg.model}
    if ckpt is not None:
        report.update(checkpoint=str(ckpt.path), step=ckpt.step)
    if packed is not None:
        report.update(score_packed(cfg, state, model, packed))
    elif docs is not None:
        report.update(score_perplexity(cfg, state, (model, tokenizer, prefix), docs))
    if settings is not None:
        results = harness_tasks.run_tasks(model, tokenizer, settings, tasks)
        report.update(harness_tasks.task_report(results, settings))
    check_finite(report, model, model.dtype)
    if prompt_ids and state.is_main_process:  # the model is whole on every process: one writes
        report["generation"] = continuations(cfg, ckpt, (model, tokenizer), prompt_ids, sampling)
    report.update(dtype=str(model.dtype).replace("torch.", ""), processes=state.num_processes)
    return report


def prompt_texts(cfg: Config) -> tuple[list[str], generate.Sampling]:
    """--prompt's and --prompt_file's prompts (none: no generation) and the sampling settings, checked."""
    prompts = [p for given in cfg.prompt for p in ([given] if isinstance(given, str) else given)]  # argparse: lists
    for i, text in enumerate(prompts):
        if not text.strip():
            raise UserError(f"--prompt {text!r} (prompt {i + 1}) is empty; give text to continue")
    if cfg.prompt_file:
        prompts += generate.read_prompt_file(cfg.prompt_file)
    sampling = generate.Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
    if prompts:
        generate.check_sampling(sampling)
        if cfg.update_card and not (cfg.dataset or cfg.tasks):
            raise UserError("--update_card adds scores to the card, and --prompt alone scores nothing: add --dataset "
                            "(or --tasks), or drop --update_card")  # fmt: skip
    return prompts, sampling


def model_context(cfg: Config, ckpt: run_model.RunCheckpoint | None) -> int:
    """The model's context (max_position_embeddings), from its config alone: prompts are refused before it is built."""
    from transformers import AutoConfig

    config = checkpoint.read_model_config(ckpt.path) if ckpt is not None else AutoConfig.from_pretrained(cfg.model)
    return config.max_position_embeddings


def checked_prompts(cfg: Config, ckpt, tokenizer, prompts: list[str], sampling) -> list[list[int]]:
    """Each prompt's token ids after the start token, each with room for --max_new_tokens in the model's context."""
    if not prompts:
        return []
    context = model_context(cfg, ckpt)
    ids = []
    for i, text in enumerate(prompts):
        where = f"prompt {i + 1} ({cli.shown(text[:40])}{'...' if len(text) > 40 else ''})"
        ids.append(generate.prompt_ids(tokenizer, text, where))
        generate.check_room(ids[-1], sampling.max_new_tokens, context, where)
    return ids


def has_mtp(cfg: Config, ckpt: run_model.RunCheckpoint | None) -> bool:
    """Whether MTP modules came with the model: a checkpoint of a run with --mtp_depth, or an export's mtp.safetensors."""
    if ckpt is not None:
        state = json.loads((ckpt.path / "trainer_state.json").read_text())
        return bool(state.get("config", {}).get("mtp_depth", 0))
    return (Path(cfg.model).expanduser() / mtp.EXPORT_FILE).is_file()


def continuations(cfg: Config, ckpt, loaded: tuple, prompt_ids: list[list[int]], sampling) -> dict:
    """The report's "generation": the settings, and each prompt's continuation (generate.continue_prompts)."""
    model, tokenizer = loaded
    if has_mtp(cfg, ckpt):
        print("note: the model's MTP modules are not used for sampling: the continuations are the main model's, one "
              "token per forward")  # fmt: skip
    t0 = time.perf_counter()
    samples = generate.continue_prompts(model, tokenizer, prompt_ids, sampling, model.device)
    seconds = time.perf_counter() - t0
    return {**dataclasses.asdict(sampling), "settings": sampling.describe(), "samples": samples,
            "seconds": seconds, "new_tokens_per_s": sum(s["new_tokens"] for s in samples) / seconds}  # fmt: skip


def say_device(cfg: Config, state, device: torch.device, dtype: torch.dtype, verb: str = "scoring") -> None:
    """The first lines: the device and dtype the model is scored on, and why there is no GPU where CUDA_VISIBLE_DEVICES
    hid them all (a README command once named a fourth GPU on a machine of three: fp32 on the CPU, unsaid). A --device
    cuda with none visible is refused."""
    if device.type == "cuda" and not torch.cuda.is_available():
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = "" if shown is None else f" (CUDA_VISIBLE_DEVICES={shown!r}: CUDA numbers the GPUs it shows from 0)"
        raise UserError(f"--device {cfg.device}: this process sees no CUDA device{why}; pick a GPU `nvidia-smi -L` "
                        f"lists with CUDA_VISIBLE_DEVICES, or --device cpu")  # fmt: skip
    if not state.is_main_process:
        return
    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    processes = f", {state.num_processes} processes" if state.num_processes > 1 else ""
    print(f"{verb} on {device}{name} in {str(dtype).removeprefix('torch.')}{processes}", flush=True)
    if note := distributed.no_gpu_note(device, cfg.device):
        print(note, flush=True)


def check_flags(cfg: Config) -> None:
    """The numeric flags, each on its own terms, before anything is loaded (the model's context is checked later)."""
    if cfg.batch_size < 1:
        raise UserError(f"--batch_size {cfg.batch_size} must be at least 1")
    for name in ("max_length", "stride", "max_documents", "packed_seq_len", "eval_tokens"):
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name} {getattr(cfg, name)} must be 0 (the default) or positive")
    if cfg.max_length and cfg.stride > cfg.max_length:
        raise UserError(f"--stride {cfg.stride} must be between 1 and --max_length {cfg.max_length}")
    if cfg.packed_seq_len and not (Path(cfg.dataset).expanduser() / "meta.json").is_file():
        raise UserError(f"--packed_seq_len scores a prepare_data.py directory; --dataset {cfg.dataset!r} is not one")
    if not cfg.packed_seq_len and (cfg.eval_tokens or cfg.data_mix):
        raise UserError("--eval_tokens and --data_mix go with --packed_seq_len (train.py's validation); drop them")
    if 0 < cfg.eval_tokens < cfg.packed_seq_len:
        raise UserError(f"--eval_tokens {cfg.eval_tokens} is less than one validation window of --packed_seq_len "
                        f"{cfg.packed_seq_len} tokens; raise it, or 0 for the whole validation split")  # fmt: skip
    if cfg.packed_seq_len and cfg.split != "validation":
        raise UserError(f"--packed_seq_len scores the validation split, as train.py does; not --split {cfg.split}: "
                        "add --split validation")  # fmt: skip


def check_output_path(name: str) -> None:
    """Refuse, before the evaluation, an --output_json that the report could not be written to after it."""
    path = Path(name)
    if path.is_dir():
        raise UserError(f"--output_json {name} is a directory; name a file in it, e.g. {path / 'report.json'}")
    parent = path.parent
    while not parent.exists():  # the directories the report will create; the nearest one that exists must take them
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"--output_json {name}: {parent} is a file, not a directory; pick another path")
    try:  # a real write answers for permissions, ACLs and read-only mounts alike
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        raise UserError(
            f"--output_json {name}: cannot write in {parent} ({e.strerror}); pick a writable path"
        ) from None


def print_report(report: dict) -> None:
    processes = f"{report['processes']} process{'es' if report['processes'] > 1 else ''}"
    model = f"{report['checkpoint']} (step {report['step']})" if "checkpoint" in report else report["model"]
    if "nll" in report:
        print(
            f"{model} on {report['dataset']} [{report['split']}], text transform: {report['text_transform']}, "
            f"max_length {report['max_length']}, stride {report['stride']}, {report['dtype']}, {processes}"
        )
        for key in ("documents", "tokens", "words", "bytes"):
            print(f"  {key:<17}{report[key]:>14,}")
        for key in ("nll", "token_perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"):
            print(f"  {key:<17}{report[key] if report[key] is not None else math.inf:>14.4f}")
        for note in report.get("notes", []):
            print(f"  note: {note}")
        print(f"  {report['tokens_per_s']:,.0f} tokens/s ({report['seconds']:.1f}s)")
    if "packed_seq_len" in report:
        print(
            f"{model} on {report['dataset']} [validation] as train.py validates it: {report['windows']:,} windows of "
            f"{report['packed_seq_len']} tokens, document masking {'on' if report['document_masking'] else 'off'}, "
            f"{report['dtype']}, {processes}"
        )
        for key in sorted(k for k in report if k.startswith(("val_loss", "val_ppl", "val_bpb"))):
            print(f"  {key:<28}{report[key]:>12.6f}")
    if "tasks" in report:
        batch_size = report["task_settings"]["batch_size"]
        print(f"{model}, lm-evaluation-harness tasks, {report['dtype']}, batch size {batch_size}, {processes}")
        print(harness_tasks.results_table(report))
    if "generation" in report:
        gen = report["generation"]
        print(f"{model} continues {len(gen['samples'])} prompt(s): {gen['settings']}, {report['dtype']} "
              f"({gen['new_tokens_per_s']:,.1f} new tokens/s, {gen['seconds']:.1f}s)")  # fmt: skip
        for i, sample in enumerate(gen["samples"], 1):
            end = ", the end of the document" if sample["ended"] else ""
            print(f"=== prompt {i}\n{sample['prompt']}\n--- continuation ({sample['new_tokens']} tokens{end})")
            print(sample["continuation"])


def main(argv: list[str] | None = None) -> int:
    from accelerate import PartialState

    cfg = cli.parse_config(Config, argv, __doc__.split("\n\n")[0])
    if cfg is None:
        return 2
    cli.quiet_console()
    if not cfg.model:
        cli.print_error("--model is required: a model directory such as the OUT/final that train.py writes")
        return 2
    try:
        for flag, value in (("--model", cfg.model), ("--tokenizer", cfg.tokenizer), ("--dataset", cfg.dataset),
                            ("--include_path", cfg.include_path)):  # fmt: skip
            if value:  # names the filesystem or safetensors cannot take: before Python's own checks trip on them
                cli.check_path(flag, value)
        if cfg.output_json:
            cli.check_path("--output_json", cfg.output_json, 0, beside=".{}.tmp")  # write_json_atomic's temporary
            check_output_path(cfg.output_json)
        if cfg.update_card:
            card.check_card(Path(cfg.model))
        report = evaluate(cfg)
    except UserError as e:  # the same on every process: printed once (cli.print_error)
        cli.print_error(str(e))
        return 2
    if not PartialState().is_main_process:
        return 0
    print_report(report)
    if cfg.output_json:
        path = Path(cfg.output_json)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, report)
        except OSError as e:  # a disk that filled up during the evaluation: the report is on the console above
            cli.print_error(f"--output_json {path}: {e.strerror or e}; the report above was not saved: free space")
            return 3
        print(f"wrote {path}")
    if cfg.update_card:
        try:
            print(f"added the scores to {card.add_eval(Path(cfg.model), report)}")
        except (OSError, ValueError) as e:  # a card changed during the evaluation, a full disk
            cli.print_error(f"--update_card: {e}; the card is as it was (the scores are above)")
            return 3
    return 0


if __name__ == "__main__":
    cli.exit_process(main())
