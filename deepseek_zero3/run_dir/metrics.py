"""A run's metrics: one record per log step (to metrics.jsonl, the tracker and one console line), the file read back
(a torn last line is what a kill while appending leaves), cut back on resume, and drawn as the loss curve.

    metrics_record   the record of a log step: loss, lr, grad norm, tokens/s, MFU (and HFU), peak memory, fp16 scale,
                     MoE balance
    utilisation      MFU, and HFU where the run recomputes
    console_line     its one line on the console
    append / read_metrics / truncate_metrics / plot_losses   metrics.jsonl written, read, cut back, drawn
    start_outputs    metrics.jsonl (cut back on resume), config.json and the trackers, as a run starts
    peak_memory_gib  this process's peak memory: the GPU's allocator, or the resident set on a CPU
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import time
from pathlib import Path

import torch

from deepseek_zero3.cli import write_atomic, write_json_atomic
from deepseek_zero3.evaluation import generate
from deepseek_zero3.planning import model_math
from deepseek_zero3.planning.model_math import GIB
from deepseek_zero3.run_dir import trackers
from deepseek_zero3.training_data import mixture


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far: the CUDA allocator's, or the resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


@dataclasses.dataclass
class LogWindow:
    """The steps since the last log line: how many, the summed loss terms of those not skipped (train.py's lm_loss
    `logged`, each a step's mean over its micro-batches: tensors on this process's device until the log step reduces
    them) and how many those were, and their training time (pauses for validation and checkpoints excluded)."""

    steps: int = 0
    sums: dict = dataclasses.field(default_factory=dict)
    counted: int = 0
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    def add(self, terms: dict, skipped: bool) -> None:
        """A step taken (or skipped: it counts for the throughput, not for the losses)."""
        self.steps += 1
        if skipped:
            return
        self.counted += 1
        for name, term in terms.items():
            self.sums[name] = self.sums.get(name, 0) + term

    def means(self, accelerator) -> dict[str, float]:
        """Each term's mean over the steps counted and all processes (collective: one all-reduce)."""
        if not self.counted:
            return {"loss": float("nan")}
        names = list(self.sums)
        total = accelerator.reduce(torch.stack([torch.as_tensor(self.sums[n]).float() for n in names]), "sum")
        return {n: float(v) / (self.counted * accelerator.num_processes) for n, v in zip(names, total)}


def fp16_loss_scale(engine, scaler) -> float | None:
    """The current fp16 loss scale: DeepSpeed's dynamic scaler, or Accelerate's GradScaler without DeepSpeed."""
    if engine is not None and hasattr(engine.optimizer, "loss_scale"):
        return float(engine.optimizer.loss_scale)
    if scaler is not None:
        return float(scaler.get_scale())
    return None


def metrics_record(run, training, step: int, log_window: LogWindow, last: dict) -> dict:
    """The metrics of a log step (run and training: train.py's RunSettings and TrainingObjects); `last` holds the step's
    lr and grad_norm. Loss and memory are over all processes."""
    accelerator = training.accelerator
    terms = log_window.means(accelerator)
    tokens_per_s = log_window.steps * run.batch.tokens_per_step / (time.perf_counter() - log_window.t0)
    mem = float(
        accelerator.gather(torch.tensor([peak_memory_gib(accelerator.device)], device=accelerator.device)).max()
    )
    record = {
        "step": step,
        "tokens": step * run.batch.tokens_per_step,
        **terms,  # loss, then the other terms train.py's lm_loss logs (mtp_loss_k, moe_aux_loss, yours)
        **last,
        "tokens_per_s": tokens_per_s,
        **utilisation(tokens_per_s, training.planned),
        "peak_mem_gib": mem,
        "epoch": step * run.batch.sequences_per_step / run.data.n_windows,
        "samples_seen": step * run.batch.sequences_per_step,
    }
    record.update(source_tokens(run, step))
    record["skipped_steps"] = training.skips.total
    if run.launch.precision == "fp16":
        record["loss_scale"] = fp16_loss_scale(training.engine, accelerator.scaler)
    if training.balancer:
        record.update(training.balancer.metrics(accelerator))
    return record


def utilisation(tokens_per_s: float, planned) -> dict:
    """`mfu`: the model FLOPs a second (planned.flops_per_token: PaLM's count, no recomputation, no optimizer work)
    over the peak of all processes; and `hfu` where the run recomputes (activation checkpointing, the loss in chunks):
    the FLOPs the hardware runs (planned.hardware_flops_per_token) over the same peak. planned: plan.RunPlan. The plan
    states the same two figures for its own step time, and its --assumed_mfu is this MFU."""
    record = {"mfu": model_math.mfu(tokens_per_s, planned.flops_per_token, planned.peak_flops)}
    if planned.hardware_flops_per_token > planned.flops_per_token:
        record["hfu"] = model_math.mfu(tokens_per_s, planned.hardware_flops_per_token, planned.peak_flops)
    return record


def source_tokens(run, step: int) -> dict:
    """Training tokens each source has given by `step` (`tokens/<source>`), when the run mixes several."""
    if len(run.data.sources) < 2:
        return {}
    given = mixture.counts(step * run.batch.sequences_per_step, run.data.weights)
    return {f"tokens/{s.name}": n * run.batch.seq_len for s, n in zip(run.data.sources, given)}


def validation_metrics(sources, weights, losses: dict[str, float]) -> dict:
    """`val_loss`: the sources' validation losses weighted as the mixture weights them (one source: its loss), and each
    source's own (`val_loss/<source>`) when there are several. `val_bpb`, bits per byte: the loss in bits over the
    UTF-8 bytes of text per token of the validation split (prepare_data.py counts both), so runs with different
    tokenizers compare; for a mixture, its bits over its bytes per token, each weighted as in val_loss. Left out where
    the data does not record its bytes. (sources, weights: token_data.TrainingData's; also eval.py's.)"""
    weights = {s.name: w for s, w in zip(sources, weights) if w > 0 and s.name in losses}
    total = sum(weights.values())
    val = sum(float(w / total) * losses[name] for name, w in weights.items()) if total else float("nan")
    record = {"val_loss": val, "val_ppl": perplexity(val)}
    per_token = {s.name: s.val_bytes_per_token for s in sources}
    if total and all(per_token[name] for name in weights):
        record["val_bpb"] = val / math.log(2) / sum(float(w / total) * per_token[n] for n, w in weights.items())
    if len(sources) > 1:
        record.update({f"val_loss/{name}": loss for name, loss in losses.items()})
        record.update({f"val_bpb/{n}": loss / math.log(2) / per_token[n] for n, loss in losses.items() if per_token[n]})
    return record


def perplexity(loss: float) -> float:
    """exp(loss), inf where that is past the largest float (a loss over ~709.8 nats: a diverged model's), not an
    OverflowError that would end the run, or the evaluation, at the line that reports it."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def validation_record(run, step: int, losses: dict[str, list[float]], samples=None) -> tuple[dict, str]:
    """The record (validation_metrics) and console line of a validation at `step`; losses: each source's main loss,
    then its MTP depths' (`val_mtp_loss_k`, the sources weighted as for val_loss); samples: (what the model wrote, the
    seconds it took), generate.TrainingSamples.take's, as `samples` (a list) and `sample_s`, a line each."""
    record = {"step": step, "tokens": step * run.batch.tokens_per_step}
    record.update(validation_metrics(run.data.sources, run.data.weights, {n: v[0] for n, v in losses.items()}))
    for k in range(1, len(next(iter(losses.values()), [0]))):
        depth = validation_metrics(run.data.sources, run.data.weights, {n: v[k] for n, v in losses.items()})
        record[f"val_mtp_loss_{k}"] = depth["val_loss"]
        record.update({f"val_mtp_loss_{k}/{n}": v for n, v in [(n, depth.get(f"val_loss/{n}")) for n in losses] if v})
    console = f"step {step} | val loss {record['val_loss']:.4f} | val ppl {record['val_ppl']:.2f}"
    console += f" | val bpb {record['val_bpb']:.4f}" if "val_bpb" in record else ""
    if len(run.data.sources) > 1:
        console += "".join(f" | {name} {loss[0]:.4f}" for name, loss in losses.items())
    depths = [(k[13:], v) for k, v in record.items() if k.startswith("val_mtp_loss_") and "/" not in k]
    console += "".join(f" | MTP {k} {v:.4f}" for k, v in depths)
    if samples is not None:
        record["samples"], record["sample_s"] = samples
        console += f" | samples {record['sample_s']:.1f}s" + "".join(
            f"\n  sample {i}: {generate.shown(s)}" for i, s in enumerate(record["samples"], 1)
        )
    return record, console


def console_line(r: dict, total_steps: int) -> str:
    return (
        f"step {r['step']}/{total_steps} | loss {r['loss']:.4f} | "
        + "".join(f"MTP {k[9:]} {v:.4f} | " for k, v in r.items() if k.startswith("mtp_loss_"))
        + f"lr {r['lr']:.2e} | grad {r['grad_norm']:.3f} | "
        f"{r['tokens_per_s']:,.0f} tok/s | MFU {model_math.percent(r['mfu'])}"
        + (f" (HFU {model_math.percent(r['hfu'])})" if "hfu" in r else "")
        + f" | peak mem {r['peak_mem_gib']:.2f} GiB"
        + (f" | scale {r['loss_scale']:.0f}" if r.get("loss_scale") is not None else "")
        + (f" | skipped {r['skipped_steps']}" if r.get("skipped_steps") or "loss_scale" in r else "")
        + (
            f" | MaxVio {r['moe_maxvio_max']:.3f} worst, {r['moe_maxvio_mean']:.3f} mean"
            if "moe_maxvio_max" in r
            else ""
        )
        + (f" | aux {r['moe_aux_loss']:.2e}" if "moe_aux_loss" in r else "")
    )


def plot_losses(metrics_path: Path, png_path: Path) -> None:
    """The loss curve; for a MoE model, a second panel with the expert-load imbalance (MaxVio) and the balance loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, _ = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    sources = sorted({k.split("/", 1)[1] for r in records for k in r if k.startswith("val_loss/")})
    balance = [r for r in records if "moe_maxvio_max" in r]
    fig, axes = plt.subplots(2 if balance else 1, 1, figsize=(7, 7 if balance else 4.2), sharex=True, squeeze=False)
    ax = axes[0, 0]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    for key in sorted({k for r in records for k in r if k.startswith("mtp_loss_")}):
        ax.plot(*zip(*[(r["step"], r[key]) for r in records if key in r]), label=f"MTP depth {key[9:]} loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss" + (" (mixed)" if sources else ""), ms=4)
    for name in sources:
        points = [(r["step"], r[f"val_loss/{name}"]) for r in records if f"val_loss/{name}" in r]
        ax.plot(*zip(*points), ".--", label=f"validation: {name}".replace("$", r"\$"), ms=3, lw=1)  # not mathtext
    ax.set(ylabel="cross-entropy (nats/token)", title=metrics_path.parent.name.replace("$", r"\$"))
    if balance:
        steps = [r["step"] for r in balance]
        bottom = axes[1, 0]
        bottom.plot(steps, [r["moe_maxvio_max"] for r in balance], label="MaxVio, worst layer", lw=1)
        bottom.plot(steps, [r["moe_maxvio_mean"] for r in balance], label="MaxVio, mean of layers", lw=1)
        bottom.set(ylabel="max load / mean load - 1")
        if any("moe_aux_loss" in r for r in balance):
            aux = bottom.twinx()
            aux.plot(steps, [r.get("moe_aux_loss", float("nan")) for r in balance], "k:", label="balance loss", lw=1)
            aux.set(ylabel="balance loss")
            aux.legend(loc="upper center")
    for ax in axes[:, 0]:
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    axes[-1, 0].set(xlabel="optimizer step")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def append(metrics_path: Path, record: dict) -> None:
    """One line onto metrics.jsonl, strict JSON (a skipped step's loss and gradient norm, not finite, are null); a
    failed write (a full disk) names the file, which Python's error does not."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    try:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(finite, allow_nan=False) + "\n")
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(metrics_path)) from None


def scalar(value) -> bool:
    """A value metrics.jsonl holds: a number, a string or null; or, a validation's `samples`, a list of records of
    those."""
    if isinstance(value, list):
        return all(isinstance(v, dict) and all(map(scalar, v.values())) for v in value)
    return value is None or isinstance(value, (int, float, str))


def read_metrics(metrics_path: Path) -> tuple[list[dict], int]:
    """The records of metrics.jsonl and the number of lines that are not one: a kill or a full disk while appending
    tears the last line, which is dropped; no line is ever fatal."""
    records, bad = [], 0
    for line in metrics_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            if isinstance(record, dict) and isinstance(record.get("step"), int) and all(map(scalar, record.values())):
                records.append(record)
            elif line.strip():
                bad += 1
        except ValueError:
            bad += 1
    return records, bad


def truncate_metrics(metrics_path: Path, step: int) -> int:
    """Lines logged after the checkpoint by the run that died would be logged again: drop them, and any torn line.
    Returns the number of torn lines dropped."""
    records, bad = read_metrics(metrics_path)
    write_atomic(metrics_path, "".join(json.dumps(r) + "\n" for r in records if r["step"] <= step))
    return bad


def start_outputs(run, accelerator, mem_before_model_gib: float, n_params: int) -> trackers.Trackers:
    """metrics.jsonl (a resumed run's, cut back to its checkpoint), config.json and the trackers (started)."""
    cfg, out = run.cfg, Path(run.cfg.output_dir)
    step = run.resume.state["step"] if run.resume is not None else 0
    settings = {"written_by": "train.py", **dataclasses.asdict(cfg), "batch_plan": dataclasses.asdict(run.batch)}
    settings.update(total_steps=run.total_steps, precision=run.launch.precision)
    history = []  # metrics.jsonl as the trackers are to hold it, up to this segment's start
    if accelerator.is_main_process:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # the launcher's --max_restarts count
        old = read_metrics(out / "metrics.jsonl")[0] if (out / "metrics.jsonl").exists() else None
        if run.resume is not None and old is not None:
            torn = truncate_metrics(out / "metrics.jsonl", step)
            history = [r for r in old if r["step"] <= step]
            if torn:
                print(f"warning: dropped {torn} torn line(s) of {out / 'metrics.jsonl'} (a write cut short)")
        else:
            write_atomic(out / "metrics.jsonl", "")
        if run.resume is not None or (restart and old is not None):  # a restart before any checkpoint starts over
            # What the resume cost: the steps the stopped run took after its checkpoint (as far as it logged them).
            lost = max([0, *(r["step"] - step for r in old or [])])
            event = {"step": step, "event": "resume", "restart": restart, "lost_steps": lost}
            append(out / "metrics.jsonl", event)
            history.append(event)
            where = f"{run.resume.path.name} (step {step})" if run.resume is not None else "the start (no checkpoint)"
            print(f"{f'restart {restart} by the launcher: ' if restart else ''}resumed from {where}; {lost} step(s) "
                  f"logged after it were lost")  # fmt: skip
        for name, (before, after) in (run.resume.changed if run.resume is not None else {}).items():
            append(
                out / "metrics.jsonl", {"step": step, "event": "change", "setting": name, "from": before, "to": after}
            )
        write_json_atomic(out / "config.json", {**settings, "peak_mem_before_model_gib": mem_before_model_gib})
    settings.update(parameters=n_params, data_fingerprint=run.data.fingerprint, processes=accelerator.num_processes)
    return trackers.start(accelerator, trackers.names_of(cfg.log_with), out, history, step, settings)
