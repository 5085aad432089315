"""--log_with: the trackers a run reports to, one tracker run per training run.

A training run is one tracker run across stops, `--resume auto`, `--max_restarts` restarts and a changed number of
processes. The first segment keeps each tracker's identity in OUT/trackers.json (W&B's run id, trackio's run name,
MLflow's run id) and every later one reuses it; TensorBoard writes to one directory, OUT/deepseek-zero3/. The run's
settings (the full Config, the batch plan, the parameter count, the data's fingerprint) are logged once, by the segment
that created the tracker run.

Each step reaches each tracker once and the step axis never goes back. A killed segment's tracker may not have
stored its last steps (W&B and trackio write from a queue, TensorBoard from a buffer), so a later segment asks the
tracker what it holds and sends the rest: first metrics.jsonl's records up to the checkpoint, then the steps it
trains. What each tracker is asked: trackio its database, MLflow its run's loss history, W&B offline its files under
OUT/wandb/ (one directory per segment, the same run id: `wandb sync OUT/wandb/offline-run-*` uploads them in order as
one run), W&B online the resumed run's step; TensorBoard cannot say, so a later segment hides every earlier event
(purge_step 0) and writes the whole history again. The first step sent after a resume carries its fields
("resumed_at_step", "lost_steps", "launcher_restart").
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

from deepseek_zero3.cli import UserError, write_json_atomic

KNOWN = ("wandb", "trackio", "tensorboard", "mlflow")  # those whose run a resume can continue
PACKAGES = {"wandb": "wandb", "trackio": "trackio", "tensorboard": "tensorboard", "mlflow": "mlflow"}
PROJECT = "deepseek-zero3"  # W&B's and trackio's project, MLflow's experiment, TensorBoard's directory in OUT
FILE = "trackers.json"


def check(log_with: str) -> list[str]:
    """--log_with's trackers (comma-separated), each known and installed: refused before the run starts, not
    Accelerate's ValueError, or a warning and a run with no tracker at all."""
    from accelerate.utils import imports

    names = [n.strip() for n in log_with.split(",") if n.strip()]
    if log_with and not names:
        raise UserError(f"--log_with {log_with!r} names no tracker; e.g. --log_with tensorboard, or leave it out")
    for name in names:
        if name not in KNOWN:
            raise UserError(
                f"--log_with {name!r}: name one or more of {', '.join(KNOWN)} (comma-separated; the trackers whose "
                f"run a resumed run continues)"
            )
        if not getattr(imports, f"is_{name}_available")():
            raise UserError(f"--log_with {name}: the {name} package is not installed; pip install {PACKAGES[name]}")
    if len(set(names)) < len(names):
        raise UserError(f"--log_with {log_with!r} names a tracker twice")
    if "wandb" in names and not _wandb_can_log():
        raise UserError(
            "--log_with wandb: no W&B API key on this machine (wandb login, or WANDB_API_KEY); or WANDB_MODE=offline "
            "to log into OUT/wandb/ and `wandb sync` it later"
        )
    return names


def _wandb_can_log() -> bool:
    """Offline or disabled W&B needs no key; online, a key in WANDB_API_KEY or `wandb login`'s netrc entry (checked
    here, not by W&B's own prompt after the model is built, which a run with no terminal cannot answer)."""
    import netrc
    import os
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE", "online") in ("offline", "disabled", "dryrun"):
        return True
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


@dataclasses.dataclass
class Trackers:
    """The started trackers (main process; elsewhere none) and, per tracker, the last step it already holds."""

    accelerator: object
    floors: dict[str, int]
    pending: dict  # the resume's fields, sent with the first step after it

    def log(self, record: dict) -> None:
        """A metrics.jsonl record, its numbers only, to each tracker that lacks its step."""
        if not self.floors:
            return
        if "event" in record:  # a resume, a changed setting, a stop: sent with the next step, or not at all
            return
        values = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        for name, floor in list(self.floors.items()):
            if record["step"] <= floor:
                continue
            sent = {**self.pending.pop(name, {}), **values}
            if name == "mlflow":  # its file store cannot hold both "val_loss" and "val_loss/python-docs"
                sent = {k.replace("/", "."): v for k, v in sent.items()}
            try:
                self.accelerator.get_tracker(name, unwrap=False).log(sent, step=record["step"])
            except Exception as e:  # noqa: BLE001 - a tracker's failure (its disk, its server) must not end the run
                del self.floors[name]
                print(
                    f"warning: --log_with {name} failed at step {record['step']} ({type(e).__name__}: {e}); the run "
                    f"goes on without it, metrics.jsonl has every step, and a resume sends {name} what it lacks"
                )


def start(accelerator, names: list[str], out: Path, history: list[dict], resumed: dict | None, settings: dict):
    """Start the trackers as the run's tracker runs: new ones for a run that has none yet, with `settings` logged,
    or the ones OUT/trackers.json names, sent what metrics.jsonl holds (`history`, up to the checkpoint) and they lack.
    resumed: the resume's fields (sent with the first step after it), None for a first segment. Returns Trackers."""
    if not names:
        return Trackers(accelerator, {}, {})
    from accelerate.tracking import filter_trackers

    kept = _kept(out / FILE) if accelerator.is_main_process else {}
    ids = {name: kept.get(name) or _new_identity(name, out) for name in names}
    init_kwargs = {n: _init_kwargs(n, ids[n], out, n in kept) for n in names if accelerator.is_main_process}
    accelerator.log_with = filter_trackers(names, accelerator.logging_dir)  # a resumed run's: its checkpoint's
    accelerator.init_trackers(PROJECT, config=None, init_kwargs=init_kwargs)
    if not accelerator.is_main_process:
        return Trackers(accelerator, {}, {})
    for name in names:
        if name not in kept:
            accelerator.get_tracker(name, unwrap=False).store_init_configuration(_flat(settings))
    if "mlflow" in names:
        ids["mlflow"] = {"run_id": accelerator.get_tracker("mlflow", unwrap=True).info.run_id}
    write_json_atomic(out / FILE, {**kept, **ids})
    trackers = Trackers(accelerator, {n: _held(accelerator, n, ids[n]) if n in kept else -1 for n in names}, {})
    for record in history:  # what a killed segment logged but its tracker never stored (buffered, queued)
        trackers.log(record)
    trackers.pending = {name: dict(resumed) for name in names} if resumed else {}
    return trackers


def _kept(path: Path) -> dict:
    """OUT/trackers.json as the first segment wrote it; a damaged one costs the tracker runs' continuity only."""
    if not path.is_file():
        return {}
    try:
        kept = json.loads(path.read_text())
        if isinstance(kept, dict) and all(isinstance(v, dict) for v in kept.values()):
            return kept
    except (OSError, ValueError):
        pass
    print(f"warning: {path} is damaged (not the JSON train.py writes); the trackers start new runs for this run")
    return {}


def _init_kwargs(name: str, identity: dict, out: Path, continued: bool) -> dict:
    """What Accelerate hands the tracker to start (or continue) the run's tracker run."""
    if name == "wandb":
        return {"id": identity["id"], "name": out.name, "resume": "allow", "dir": str(out)}
    if name == "trackio":
        return {"name": identity["name"], "resume": "allow"}
    if name == "mlflow":
        return {"run_id": identity.get("run_id"), "run_name": out.name}
    # TensorBoard: its event files buffer writes, so a killed segment's may lack any of its steps. A later segment
    # hides every earlier event (purge_step 0) and writes the whole history again, from metrics.jsonl.
    return {"purge_step": 0} if continued else {}


def _new_identity(name: str, out: Path) -> dict:
    """A tracker run's identity, unique across runs (two output directories with the same name stay apart)."""
    tag = uuid.uuid4().hex[:8]
    return {"wandb": {"id": tag}, "trackio": {"name": f"{out.name}-{tag}"}}.get(name, {})


def _held(accelerator, name: str, identity: dict) -> int:
    """The last step the tracker's run already holds (-1: none, or a tracker that cannot say)."""
    if name == "trackio":
        from trackio.sqlite_storage import SQLiteStorage

        held = SQLiteStorage.get_max_step_for_run(PROJECT, run=identity["name"])
        return -1 if held is None else held
    if name == "mlflow":
        from mlflow.tracking import MlflowClient

        history = MlflowClient().get_metric_history(identity["run_id"], "loss")
        return max((m.step for m in history), default=-1)
    if name == "wandb":
        run = accelerator.get_tracker("wandb", unwrap=True)
        if run.settings.mode == "offline":
            rows = wandb_offline_history(Path(run.settings.wandb_dir), identity["id"])[1]
            return max((step for step, _ in rows), default=-1)
        return run.step - 1 if run.resumed and run.step else -1  # online: the resumed run's next step
    return -1  # tensorboard: purge_step hid what earlier segments wrote


def _flat(settings: dict, prefix: str = "") -> dict:
    """Nested settings as flat scalars, as every tracker's config takes them ("batch_plan/micro_batch_size")."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[prefix + key] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def wandb_offline_history(wandb_dir: Path, run_id: str = "*") -> tuple[set[str], list[tuple[int, dict]], list[dict]]:
    """What W&B's offline files (wandb_dir/offline-run-*-ID/run-ID.wandb, one per segment) hold, segment after segment:
    the run ids, each logged row's (step, values) and the settings logged. A segment killed before W&B wrote its
    last rows holds fewer than were logged; a torn last record is left out. The file: a 7-byte header (":W&B", magic,
    version), then 32 KiB blocks of chunks, each headed by 7 bytes (CRC, length, kind: 1 a whole record, 2 3 4 its
    first, middle and last pieces; a block's tail too short for a header is padding), each record a protobuf of W&B's
    own classes."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    ids, rows, configs, block = set(), [], [], 32768
    for path in sorted(wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        data, pos, pieces = path.read_bytes(), 7, b""
        while data.startswith(b":W&B") and pos + 7 <= len(data):
            if block - pos % block < 7:
                pos += block - pos % block
                continue
            length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
            pieces = (b"" if kind in (1, 2) else pieces) + data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind not in (1, 4) or pos > len(data):
                continue
            record = pb.Record()
            try:
                record.ParseFromString(pieces)
            except DecodeError:
                break
            if record.HasField("run"):
                ids.add(record.run.run_id)
                configs.append({i.key: json.loads(i.value_json) for i in record.run.config.update if i.key != "_wandb"})
            elif record.HasField("config") and configs:
                configs[-1].update({i.key: json.loads(i.value_json) for i in record.config.update if i.key != "_wandb"})
            elif record.HasField("history"):
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                rows.append((record.history.step.num, row))
    return ids, rows, configs
