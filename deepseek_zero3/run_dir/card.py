"""final/README.md: the model card a finished run writes beside its model, in the Hub's format (YAML front matter with
a model-index of the validation results, read by huggingface_hub's ModelCard), from what the run measured: the
records of OUT/metrics.jsonl (every segment of a resumed run: the tokens are the last record's, counted from step 1),
the run's settings and its model config. eval.py --update_card adds its own report's scores to the same card.

    write_card   the card of a finished run (run_dir/finish.py, after the export)
    add_eval     eval.py's report into a card (eval.py --update_card)
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

from deepseek_zero3.cli import one_line

CARD = "README.md"
EVAL_HEADING = "## Scores from eval.py"


def last_by_step(records: list[dict]) -> list[dict]:
    """The training log records of the run as it stands: a step logged again after a resume keeps its last record."""
    return sorted({r["step"]: r for r in records if "loss" in r}.values(), key=lambda r: r["step"])


def timed_records(records: list[dict]) -> list[tuple[dict, float]]:
    """Each training log record with the seconds of training steps it covers, from its tokens and throughput over every
    segment (validation, checkpoints and restarts not counted)."""
    steps = last_by_step(records)
    timed, tokens = [], 0
    if records and records[0].get("event") == "resume" and steps:  # a log that starts at a checkpoint (a branch)
        tokens = records[0]["step"] * steps[0]["tokens"] // steps[0]["step"]
    for r in steps:
        if r.get("tokens_per_s"):
            timed.append((r, (r["tokens"] - tokens) / r["tokens_per_s"]))
        tokens = r["tokens"]
    return timed


def training_seconds(records: list[dict]) -> float:
    """Seconds spent in training steps over every segment (timed_records)."""
    return sum(seconds for _, seconds in timed_records(records))


def speed_line(records: list[dict]) -> str:
    """The card's line on the run's speed over its training time: tokens/s, MFU and, where the run recomputed, HFU,
    each the time-weighted mean of the log records' (MFU so is the run's model FLOPs over its seconds and peak;
    metrics.utilisation says what each counts). A record without `hfu` recomputed nothing: its HFU is its MFU."""
    from deepseek_zero3.planning import model_math

    timed = [(r, seconds) for r, seconds in timed_records(records) if isinstance(r.get("mfu"), (int, float))]
    total = sum(seconds for _, seconds in timed)
    if total <= 0:
        return ""
    mean = lambda key: sum(r.get(key, r["mfu"]) * seconds for r, seconds in timed) / total
    hfu = (f", HFU {model_math.percent(mean('hfu'))} (the FLOPs the hardware ran, the recomputed ones too: activation "
           "checkpointing, the loss's chunks)" if any("hfu" in r for r, _ in timed) else "")  # fmt: skip
    return (f"\n- Speed: {mean('tokens_per_s'):,.0f} tokens/s, MFU {model_math.percent(mean('mfu'))} (model FLOPs "
            "per token: 6 x the activated non-embedding parameters + the attention over all token pairs, PaLM's count, "
            f"over the peak){hfu}.")


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor())
    return f"{cpu or 'CPU'} ({os.cpu_count()} cores)"


def _results(val: dict, dataset: str) -> list:
    """The model-index entries of the run's last validation record (val: {} when it has none)."""
    from huggingface_hub import EvalResult

    names = {"val_loss": ("loss", "validation loss (nats/token)"), "val_ppl": ("perplexity", "validation perplexity"),
             "val_bpb": ("bits_per_byte", "validation bits per byte")}  # fmt: skip
    results = []
    for key, value in val.items():
        base, _, source = key.partition("/")
        if base in names and isinstance(value, float) and math.isfinite(value):
            kind, label = names[base]
            results.append(EvalResult(task_type="text-generation", task_name="Causal language modeling",
                                      dataset_type=dataset, dataset_name=source or dataset, dataset_split="validation",
                                      metric_type=kind, metric_name=f"{label}{f' ({source})' if source else ''}",
                                      metric_value=round(value, 6)))  # fmt: skip
    return results


def mtp_line(cfg) -> str:
    """The card's line on the run's MTP modules (train.py --mtp_depth), or nothing."""
    depth = getattr(cfg, "mtp_depth", 0)
    if depth <= 0:
        return ""
    return (f"\n- Multi-token prediction (DeepSeek-V3): {depth} module(s) trained beside the model, loss weight "
            f"{cfg.mtp_loss_weight}; not part of this model, they are in `mtp.safetensors` beside it in DeepSeek-V3's "
            "layout (decoder layer num_hidden_layers + k - 1); `val_mtp_loss_k` is module k's loss.")  # fmt: skip


def samples_section(cfg, val: dict, seconds: float) -> str:
    """The card's samples: what the final model wrote at the run's last validation (train.py --sample_tokens), with
    the settings that made them and the seconds all the run's samples took; nothing where the run took none."""
    samples = val.get("samples")
    if not samples:
        return ""
    prompts = ("the first 16 tokens of held-out validation documents" if not cfg.sample_prompts else
               "the run's --sample_prompts")  # fmt: skip
    blocks = "\n\n".join(
        f"{i}. prompt: `{one_line(s['prompt'])}`\n\n```text\n{s['prompt']}{s['continuation']}\n```"
        + ("\n\n(the model ended the document there)" if s.get("ended") else "")
        for i, s in enumerate(samples, 1)
    )
    return f"""
## Samples (step {val["step"]})

What this model writes: greedy decoding (the most likely token each time) of up to {cfg.sample_tokens} tokens after
{prompts}, by transformers' `generate` at the run's last validation, whose weights are these. Each block is the
prompt followed by the continuation. The samples of all validations took {seconds:.1f} s, not counted in the time in
training steps. `python eval.py --model path/to/final --prompt "..."` continues text of your own.

{blocks}
"""


def write_card(final: Path, run, records: list[dict]) -> Path:
    """final/README.md for `run` (train.py's RunSettings), atomically. records: OUT/metrics.jsonl's."""
    from huggingface_hub import ModelCard, ModelCardData

    cfg, mc, launch, batch = run.cfg, run.model_config, run.launch, run.batch
    metas = {s["name"]: s for s in run.data.meta.get("sources", [])}
    hub = [metas[s.name]["spec"] for s in run.data.sources if metas.get(s.name, {}).get("kind") == "hub"]
    last = next((r for r in reversed(records) if "loss" in r), {})
    val = next((r for r in reversed(records) if "val_loss" in r), {})
    name = Path(cfg.output_dir).resolve().name
    data = ModelCardData(library_name="transformers", license="unknown", datasets=hub or None, model_name=name,
                         tags=["deepseek-zero3", "pretraining", mc.model_type],
                         eval_results=_results(val, Path(cfg.data_dir).name) or None)  # fmt: skip
    from deepseek_zero3.planning import model_math

    counts = model_math.param_counts(mc)
    moe = f", {counts['activated'] / 1e6:.2f}M activated per token" if model_math.is_moe(mc) else ""
    rows = []
    for source, weight in zip(run.data.sources, run.data.weights):
        meta = metas.get(source.name, {})  # a local file by its name: the card is for sharing, its path is not
        origin = meta.get("spec", source.name) if meta.get("kind") in ("hub", "builtin") else source.name
        seen = last.get(f"tokens/{source.name}", last.get("tokens", 0) if len(run.data.sources) == 1 else 0)
        rows.append(f"| {source.name} | {origin} ({meta.get('kind', 'local')}) | {float(weight):.3f} | {seen:,} |")
    sources = "\n".join(rows)
    scores = "\n".join(f"| {k} | {v:.4f} |" for k, v in val.items() if k.startswith("val_") and isinstance(v, float))
    seconds = training_seconds(records)
    took = f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"
    resumes = sum(1 for r in records if r.get("event") == "resume")
    skipped = last.get("skipped_steps", 0)
    speed = speed_line(records)
    branch = (f"\n- A decay branch: the run's schedule until step {cfg.decay_start_step}, then {cfg.decay_branch} "
              "steps of decay (train.py --decay_branch; its first launch counts as a resume)."
              if cfg.decay_start_step else "") + mtp_line(cfg)  # fmt: skip
    where = json.dumps(cfg.push_to_hub or "path/to/final")  # the Hub repo it is pushed to, else this directory
    body = f"""
# {name}

A {mc.model_type} model ({counts['total'] / 1e6:.2f}M parameters, {counts['non_embedding'] / 1e6:.2f}M
non-embedding{moe};
{mc.num_hidden_layers} layers, width {mc.hidden_size}, {mc.num_attention_heads} heads, vocabulary {mc.vocab_size},
context {cfg.seq_len}) pretrained from scratch{f" from {cfg.init_from}" if cfg.init_from else ""} with train.py of the
deepseek-zero3 scripts. Everything below was measured by the run itself.

## Training

- Data: `{Path(cfg.data_dir).name}` (prepare_data.py), tokenizer `{run.data.meta.get('tokenizer', '?')}`;
  {last.get('tokens', 0):,} tokens seen over {last.get('step', 0):,} steps ({last.get('epoch', 0):.3f} passes over the
  training split).

| source | from | weight | tokens seen |
|---|---|---:|---:|
{sources}

- Batch: {batch.sequences_per_step} sequences of {cfg.seq_len} tokens a step ({batch.micro_batch_size} micro x
  {batch.grad_accum_steps} accumulation x {batch.world_size} processes).
- {run.schedule.describe()}; AdamW ({cfg.adam_beta1}, {cfg.adam_beta2}), weight decay {cfg.weight_decay}, gradient
  clipping {cfg.max_grad_norm}, seed {cfg.seed}.
- Precision {launch.precision}, {f"DeepSpeed ZeRO-{launch.zero_stage}" if launch.zero_stage else "no DeepSpeed"},
  {launch.world_size} process(es) on {launch.nodes} machine(s), {device_name()}.
- Time in training steps: {took} (from the logged throughput; validation and checkpoints not counted);
  resumed {resumes} time(s) on the way; {skipped} step(s) skipped (a non-finite loss or gradient).{speed}{branch}

## Validation (step {val.get('step', '-')}, the run's own validation split)

| metric | value |
|---|---:|
{scores}

`val_loss` is nats per token; `val_bpb` bits per UTF-8 byte of text, comparable across tokenizers.
{samples_section(cfg, val, sum(r.get("sample_s", 0) for r in records))}
## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({where})
tokenizer = AutoTokenizer.from_pretrained({where})
```

License: not set (`license: unknown` above); set the one your data and use allow before sharing.
"""
    return save(final, ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))


def kept_card(final: Path) -> str | None:
    """The card of a finished run launched again, which trains nothing: kept as it is, with eval.py's scores and the
    user's edits (train.py writes it back after the export)."""
    path = final / CARD
    return path.read_text(encoding="utf-8", errors="surrogateescape") if path.is_file() else None


def save(final: Path, card) -> Path:
    path = final / CARD
    tmp = path.with_name(f".{CARD}.tmp")
    tmp.write_text(str(card), encoding="utf-8", errors="surrogateescape")
    os.replace(tmp, path)
    return path


def eval_scores(report: dict) -> list[tuple[str, str, str, float]]:
    """(data, split, metric, value) of an eval.py report: its perplexity or packed scores, and each harness task's
    metrics (their standard errors left out). The data is named by the dataset's name (a local directory by its own
    name, not its path) and, for packed scoring, the settings that change the number."""
    skip = {"seconds", "tokens_per_s", "nll"}  # nll: a sum over the tokens
    name = str(report.get("dataset"))
    name = Path(name).name if Path(name).expanduser().exists() else name
    if report.get("packed_seq_len"):  # scored as train.py validates: another number than the rolling perplexity
        settings = [f"packed {report['packed_seq_len']}", f"{report.get('eval_tokens') or 'all'} tokens"]
        settings += [f"mix {report['data_mix']}"] if report.get("data_mix") else []
        settings += [] if report.get("document_masking", True) else ["no document masking"]
        name += f" ({', '.join(settings)})"
    scores = [(name, str(report.get("split", "")), k, v) for k, v in report.items()
              if isinstance(v, float) and k not in skip and "dataset" in report]  # fmt: skip
    for task, values in (report.get("tasks") or {}).items():
        kept = {k: v for k, v in values.items() if isinstance(v, float) and "stderr" not in k}
        scores += [(task, "", k.split(",")[0], v) for k, v in kept.items()]  # "acc,none": acc
    return [s for s in scores if math.isfinite(s[3])]


def load_card(final: Path):
    """final/README.md as huggingface_hub reads it; a file it cannot read as a card raises ValueError naming why."""
    from huggingface_hub import ModelCard

    try:
        card = ModelCard.load(final / CARD)
    except Exception as e:  # noqa: BLE001 - YAML errors, an invalid model-index: whatever the parser refuses
        raise ValueError(f"{final / CARD} is not a model card huggingface_hub reads ({e})") from None
    card.data.model_name = card.data.model_name or final.resolve().name  # a model-index needs its name
    return card


def check_card(model: Path) -> None:
    """eval.py --update_card, before the evaluation: --model holds a model card that huggingface_hub reads."""
    from deepseek_zero3.cli import UserError

    if not (model / CARD).is_file():
        raise UserError(f"--update_card: {model} holds no model card ({CARD}); train.py writes one into OUT/final: "
                        "pass that directory as --model, or leave --update_card out")  # fmt: skip
    try:
        load_card(model)
    except ValueError as e:
        raise UserError(f"--update_card: {e}; fix the card's front matter, or leave --update_card out") from None


def add_eval(final: Path, report: dict) -> Path:
    """eval.py's report (its --output_json) into final/README.md: its scores in the model-index (named "... (eval.py)")
    and in the card's eval.py table, both replaced, not repeated, when eval.py adds scores of the same data again;
    the rest of the card, text after the table included, is kept."""
    from huggingface_hub import EvalResult

    card = load_card(final)
    scores = eval_scores(report)
    added = {(name, split) for name, split, _, _ in scores}
    mine = " (eval.py)"  # how the card tells eval.py's results from the run's
    kept = [r for r in card.data.eval_results or [] if not (r.metric_name or "").endswith(mine)
            or (r.dataset_name, r.dataset_split or "") not in added]  # fmt: skip
    card.data.eval_results = kept + [
        EvalResult(task_type="text-generation", dataset_type=name, dataset_name=name, dataset_split=split or None,
                   metric_type=metric, metric_name=metric + mine, metric_value=round(value, 6))
        for name, split, metric, value in scores
    ]  # fmt: skip
    head, _, rest = card.text.partition(f"\n{EVAL_HEADING}\n")
    section, _, after = rest.partition("\n## ")  # the table's section ends at the next heading
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| dataset")]
    label = {(n, s): f"{n} [{s}]" if s else n for n, s, _, _ in scores}
    rows = [r for r in rows if r.split(" | ")[0].removeprefix("| ") not in label.values()]  # the same, added again
    rows += [f"| {label[n, s]} | {m} | {v:.4f} |" for n, s, m, v in scores]
    table = "\n".join(["| dataset | metric | value |", "|---|---|---:|", *rows])
    card.text = f"{head.rstrip()}\n\n{EVAL_HEADING}\n\n{table}\n" + (f"\n## {after}" if after else "")
    return save(final, card)


def check_push(repo: str) -> None:
    """--push_to_hub REPO, checked before the run starts (not after a week of training): a valid repo id, the Hub
    not switched off, a token to write with."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from deepseek_zero3.cli import UserError

    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise UserError(f"--push_to_hub {repo!r} is not a Hub repo id; name it user/model or org/model") from None
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"--push_to_hub {repo}: HF_HUB_OFFLINE is set; unset it, or leave --push_to_hub out and "
                        "upload final/ later with `hf upload`")  # fmt: skip
    if get_token() is None:
        raise UserError(f"--push_to_hub {repo}: no Hugging Face token; run `hf auth login` or set HF_TOKEN")


def push(final: Path, repo: str, step: int, api=None) -> str:
    """Upload final/ (weights, config, tokenizer, card) to the Hub model repo `repo`, created private if it does not
    exist. Returns the commit's URL. api: huggingface_hub's HfApi (replaceable, as the tests do without the Hub)."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    api.create_repo(repo, repo_type="model", private=True, exist_ok=True)
    info = api.upload_folder(repo_id=repo, folder_path=final, repo_type="model",
                             commit_message=f"train.py: the model after step {step}")  # fmt: skip
    return str(getattr(info, "commit_url", info))


def push_final(final: Path, repo: str, step: int, api=None) -> str | None:
    """train.py --push_to_hub: push() of final/; a failure (network, permissions) leaves the model on disk, says how to
    upload it by hand, and returns None (the run then exits 3)."""
    from deepseek_zero3.cli import print_error

    try:
        url = push(final, repo, step, api)
    except Exception as e:  # noqa: BLE001 - whatever the Hub client raises, the run's work is saved
        print_error(f"--push_to_hub {repo}: {e}; the model is in {final}: upload it with `hf upload {repo} {final}`")
        return None
    print(f"pushed {final} to the Hub: {url}")
    return url


def ema_card(ema_dir: Path, ema) -> Path:
    """final_ema/README.md: what the directory is. The run's own card, beside it in final/, describes the training;
    the average's scores are eval.py's to measure (the run validates its own weights)."""
    text = (f"---\nlibrary_name: transformers\nlicense: unknown\ntags:\n- deepseek-zero3\n- ema\n---\n\n"
            f"# {ema_dir.parent.resolve().name}: moving average of the weights\n\nThe exponential moving average of "
            f"the weights of the run whose model card is in `../final/README.md` (data, batch, schedule, its own "
            f"validation): after every optimizer step taken, ema = {ema.decay:g} x ema + {1 - ema.decay:g} x "
            f"weights, in fp32 ({ema.updates} updates), exported in the dtype of the run's weights. Its scores were not "
            f"measured during training: `python eval.py --model {ema_dir.name} ...` measures them.\n")  # fmt: skip
    return save(ema_dir, text)
