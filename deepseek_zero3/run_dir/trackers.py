"""--log_with: the trackers a run reports to, one tracker run per training run.

A training run is one tracker run across stops, `--resume auto`, `--max_restarts` restarts and a changed number of
processes. The first segment keeps each tracker's identity in OUT/trackers.json (W&B's run id, trackio's run name,
MLflow's run id and store) before the tracker starts, and every later one reuses it; TensorBoard writes to one
directory, OUT/deepseek-zero3/. A copy of the directory (trackers.json naming another directory) starts new runs.

Each tracker is asked what it already holds: the last step of training and of validation records, and whether it has
the run's settings (the full Config, the batch plan, the parameter count, the data's fingerprint), which are logged
once. A killed segment's tracker may not have stored its last records (W&B and trackio write from a queue), so a later
segment sends metrics.jsonl's records up to the checkpoint that the tracker lacks, then the steps it trains. Asked:
trackio its database, MLflow its run, W&B offline its files under OUT/wandb/ (one directory per segment with the same
run id; README: `wandb sync --id ID OUT/wandb/offline-run-*`), W&B online the resumed run. TensorBoard
cannot say (its event files buffer writes): a later segment hides every earlier event (purge_step 0) and writes the
whole history again. A step the tracker holds past the checkpoint stays as the stopped segment logged it (a step axis
does not go back); a note names such steps. A resume's fields ("resumed_at_step", "lost_steps", "launcher_restart")
go with the first record sent after it. A tracker that fails is dropped with one warning; the run goes on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import uuid
from pathlib import Path

from deepseek_zero3.cli import UserError, write_json_atomic

KNOWN = ("wandb", "trackio", "tensorboard", "mlflow")  # those whose run a resume can continue
PROJECT = "deepseek-zero3"  # W&B's and trackio's project, MLflow's experiment, TensorBoard's directory in OUT
FILE = "trackers.json"


def names_of(log_with: str) -> list[str]:
    """--log_with's comma-separated names, blanks left out."""
    return [n.strip() for n in log_with.split(",") if n.strip()]


def check(log_with: str) -> list[str]:
    """--log_with's trackers (comma-separated), each known and installed: refused before the run starts, not
    Accelerate's ValueError, or a warning and a run with no tracker at all."""
    from accelerate.utils import imports

    names = names_of(log_with)
    if log_with and not names:
        raise UserError(f"--log_with {log_with!r} names no tracker; e.g. --log_with tensorboard, or leave it out")
    for name in names:
        if name not in KNOWN:
            raise UserError(
                f"--log_with {name!r}: name one or more of {', '.join(KNOWN)} (comma-separated; the trackers whose "
                f"run a resumed run continues)"
            )
        if not getattr(imports, f"is_{name}_available")():
            raise UserError(f"--log_with {name}: the {name} package is not installed; pip install {name}")
    if len(set(names)) < len(names):
        raise UserError(f"--log_with {log_with!r} names a tracker twice")
    if "wandb" in names and not (_wandb_offline() or _wandb_key()):
        raise UserError(
            "--log_with wandb: no W&B API key on this machine (wandb login, or WANDB_API_KEY); or WANDB_MODE=offline "
            "to log into OUT/wandb/ and `wandb sync` it later"
        )
    return names


def _wandb_offline() -> bool:
    """W&B set to log offline (or not at all): by WANDB_MODE, or the settings file `wandb offline` writes."""
    import configparser

    mode = os.environ.get("WANDB_MODE", "").lower()
    if os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1"):
        return True
    if not mode:
        config_dir = Path(os.environ.get("WANDB_CONFIG_DIR", Path.home() / ".config" / "wandb"))
        for path in (Path(os.environ.get("WANDB_DIR", ".")) / "wandb" / "settings", config_dir / "settings"):
            parser = configparser.ConfigParser()
            try:
                parser.read(path)
            except (configparser.Error, OSError, UnicodeDecodeError):
                continue
            mode = mode or parser.get("default", "mode", fallback="").lower()
    return mode in ("offline", "disabled", "dryrun")


def _wandb_key() -> bool:
    """A W&B key: WANDB_API_KEY, an identity token, or `wandb login`'s netrc entry (checked here, not by W&B's own
    prompt after the model is built, which a run with no terminal cannot answer)."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


@dataclasses.dataclass
class Trackers:
    """The started trackers (main process; elsewhere none): per tracker, the last step of each kind of record it
    holds ("train", "validation"), and the resume fields it is yet to be sent."""

    accelerator: object
    floors: dict[str, dict[str, int]]
    pending: dict[str, dict] = dataclasses.field(default_factory=dict)
    replaying: bool = False  # sending metrics.jsonl's records at start, not the steps this segment trains

    def log(self, record: dict) -> None:
        """A metrics.jsonl record to each tracker that lacks it: its finite numbers (a skipped step's loss is not
        sent, live or from the file); a resume event goes with the next record."""
        if not self.floors or record.get("event") not in (None, "resume"):
            return
        if record.get("event") == "resume":
            fields = {"resumed_at_step": record["step"], "lost_steps": record.get("lost_steps", 0),
                      "launcher_restart": record.get("restart", 0)}  # fmt: skip
            self.pending = {name: fields for name in self.floors}
            return
        kind = "validation" if "val_loss" in record else "train"
        values = {k: v for k, v in record.items() if k != "step" and _finite(v)}
        for name, floors in list(self.floors.items()):
            if record["step"] <= floors[kind]:
                if self.replaying:  # held: so is an earlier resume's marker, which goes with what follows it
                    self.pending.pop(name, None)
                continue
            sent = {**self.pending.pop(name, {}), **values, **samples_as(name, record.get("samples"))}
            if name == "mlflow":  # its file store cannot hold both "val_loss" and "val_loss/python-docs"
                sent = {k.replace("/", "."): v for k, v in sent.items()}
            try:
                self.accelerator.get_tracker(name, unwrap=False).log(sent, step=record["step"])
            except Exception as e:  # noqa: BLE001 - a tracker's failure (its disk, its server) must not end the run
                self._drop(name, f"failed at step {record['step']} ({type(e).__name__}: {e})")

    def _drop(self, name: str, why: str) -> None:
        self.floors.pop(name, None)
        self.accelerator.trackers = [t for t in self.accelerator.trackers if t.name != name]
        print(f"warning: --log_with {name} {why}; the run goes on without it, metrics.jsonl has every step, and a "
              f"resume sends {name} what it lacks")  # fmt: skip

    def end_training(self) -> None:
        """Each tracker finished (a failing one warned about, not turning a finished run into a failed one), then
        Accelerate's end of training (the process group)."""
        for tracker in list(self.accelerator.trackers):
            try:
                tracker.finish()
            except Exception as e:  # noqa: BLE001 - as in log
                self._drop(tracker.name, f"failed to finish ({type(e).__name__}: {e})")
        self.accelerator.trackers = []
        self.accelerator.end_training()


def samples_as(name: str, samples: list[dict] | None) -> dict:
    """A validation's samples (train.py --sample_tokens) as the tracker shows text: a table for W&B and trackio
    (step, prompt, continuation), Markdown for TensorBoard's text tab; MLflow's metrics take numbers only."""
    if not samples:
        return {}
    columns = ["sample", "prompt", "continuation"]
    rows = [[i, s["prompt"], s["continuation"]] for i, s in enumerate(samples, 1)]
    if name == "wandb":
        import wandb

        return {"samples": wandb.Table(columns=columns, data=rows)}
    if name == "trackio":
        import trackio

        return {"samples": trackio.Table(columns=columns, data=rows)}
    if name == "tensorboard":  # Markdown: a prompt in bold, then its continuation, as a code block keeps it as it is
        return {"samples": "\n\n".join(f"**{i}.** `{p!r}` →\n\n    " + c.replace("\n", "\n    ") for i, p, c in rows)}
    return {}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def start(accelerator, names: list[str], out: Path, history: list[dict], resume_step: int, settings: dict):
    """Start the trackers as the run's tracker runs (new ones, or those OUT/trackers.json names), log `settings` to
    those that lack them, and send them what of `history` (metrics.jsonl up to the checkpoint, this segment's resume
    event last) they lack. Only the main process has trackers, as with Accelerate's init_trackers (W&B's and trackio's
    would start a run on every process). Returns Trackers."""
    trackers = Trackers(accelerator, {})
    if not names or not accelerator.is_main_process:
        return trackers
    kept = _kept(out)
    ids = {name: kept.get(name) or _new_identity(name, out) for name in names}

    def save() -> None:
        write_json_atomic(out / FILE, {"output_dir": str(out.resolve()), "runs": {**kept, **ids}})

    save()  # before the trackers start: a kill while they do leaves no run the next segment would not continue
    if "mlflow" in names and ids["mlflow"].get("tracking_uri") and not os.environ.get("MLFLOW_TRACKING_URI"):
        import mlflow

        mlflow.set_tracking_uri(ids["mlflow"]["tracking_uri"])  # where the run was, whatever the working directory
    accelerator.trackers = []
    for name in names:
        try:  # W&B's or MLflow's server, trackio's database, TensorBoard's disk: the run goes on without it
            tracker = _started(name, _init_kwargs(name, ids[name], out), accelerator)
            accelerator.trackers.append(tracker)
            if name == "mlflow":
                import mlflow

                ids["mlflow"] = {"run_id": tracker.tracker.info.run_id, "tracking_uri": mlflow.get_tracking_uri()}
                save()
            held = _held(accelerator, name, ids[name], out)
            if not held.pop("settings"):
                tracker.store_init_configuration(_flat(settings))
            elif name == "trackio":  # a resumed trackio run's first row would store an empty config over it
                tracker.store_init_configuration(held.pop("stored"))
        except Exception as e:  # noqa: BLE001 - as in Trackers.log
            trackers._drop(name, f"failed to start ({type(e).__name__}: {e})")
            continue
        trackers.floors[name] = held
        if held["train"] > resume_step:
            print(
                f"note: --log_with {name} holds steps {resume_step + 1}-{held['train']} as the stopped segment "
                f"logged them; this one trains them again (metrics.jsonl has its values) and sends the steps after"
            )
    trackers.replaying = True
    for record in history:
        trackers.log(record)
    trackers.replaying = False  # this segment's resume marker, last in history, waits for the first step sent
    return trackers


def _started(name: str, init_kwargs: dict, accelerator):
    """Accelerate's tracker of that name, started."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    cls = LOGGER_TYPE_TO_CLASS[name]
    if cls.requires_logging_directory:
        tracker = cls(PROJECT, accelerator.logging_dir, **init_kwargs)
    else:
        tracker = cls(PROJECT, **init_kwargs)
    tracker.start()
    return tracker


def _kept(out: Path) -> dict:
    """The tracker runs OUT/trackers.json names, those it names well; none for a copy of the run directory."""
    path = out / FILE
    if not path.is_file():
        return {}
    try:
        kept = json.loads(path.read_text())
        runs = kept["runs"]
        where = kept["output_dir"]
        if not isinstance(runs, dict) or not isinstance(where, str):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        print(f"warning: {path} is damaged (not the JSON train.py writes); the trackers start new runs for this run")
        return {}
    if where != str(out.resolve()):
        print(f"note: {path} names the tracker runs of {where}; this run directory is a copy of it (or it moved): the "
              f"trackers start new runs here")  # fmt: skip
        return {}
    good = {name: identity for name, identity in runs.items() if name in KNOWN and _well_formed(name, identity)}
    for name in sorted(set(runs) - set(good)):
        print(f"warning: {path}: its {name!r} entry is damaged; {name} starts a new run for this run")
    return good


def _well_formed(name: str, identity) -> bool:
    field, pattern = {"wandb": ("id", r"[a-z0-9]{1,64}"), "trackio": ("name", r"[^/\\]{1,200}"),
                      "mlflow": ("run_id", r"[0-9a-f]{32}"), "tensorboard": (None, "")}[name]  # fmt: skip
    if not isinstance(identity, dict):
        return False
    if field is None or (name == "mlflow" and identity.get(field) is None):  # MLflow names its run once started
        return True
    return isinstance(identity.get(field), str) and re.fullmatch(pattern, identity[field]) is not None


def _init_kwargs(name: str, identity: dict, out: Path) -> dict:
    """What Accelerate hands the tracker to start (or continue) the run's tracker run."""
    if name == "wandb":
        return {"id": identity["id"], "name": out.name, "resume": "allow", "dir": str(out)}
    if name == "trackio":
        return {"name": identity["name"], "resume": "allow"}
    if name == "mlflow":
        return {"run_id": identity.get("run_id"), "run_name": out.name}
    # TensorBoard: a later segment hides every earlier event and writes the whole history again.
    return {"purge_step": 0} if list((out / PROJECT).glob("events.out.tfevents.*")) else {}


def _new_identity(name: str, out: Path) -> dict:
    """A tracker run's identity, unique across runs (two output directories with the same name stay apart)."""
    tag = uuid.uuid4().hex[:8]
    return {"wandb": {"id": tag}, "trackio": {"name": f"{out.name}-{tag}"}}.get(name, {})


def _held(accelerator, name: str, identity: dict, out: Path) -> dict:
    """What the tracker's run holds: the last step of training records ("train") and of validation records
    ("validation"), -1 for none or a tracker that cannot say, and whether it has the run's settings (trackio: and
    those settings, "stored")."""
    rows, settings = [], False  # rows: (step, the names logged at it)
    if name == "trackio":
        from trackio.sqlite_storage import SQLiteStorage

        rows = [(r["step"], r) for r in SQLiteStorage.get_logs(PROJECT, identity["name"])]
        stored = SQLiteStorage.get_run_config(PROJECT, identity["name"]) or {}
        settings = "parameters" in stored
        if settings:
            return {**_last_steps(rows), "settings": True, "stored": {k: v for k, v in stored.items() if k[0] != "_"}}
    elif name == "mlflow":
        from mlflow.tracking import MlflowClient

        client, run_id = MlflowClient(), identity["run_id"]
        rows = [(m.step, {key: 1}) for key in ("lr", "val_loss") for m in client.get_metric_history(run_id, key)]
        settings = "parameters" in client.get_run(run_id).data.params
    elif name == "wandb":
        run = accelerator.get_tracker("wandb", unwrap=True)
        if run.offline:  # WANDB_MODE offline or dryrun
            _, rows, configs = wandb_offline_history(Path(run.settings.wandb_dir), identity["id"])
            settings = any("parameters" in c for c in configs)
        else:  # online: the resumed run's next step (W&B merges what is logged at a step it holds)
            rows = [(run.step - 1, {"lr": 1, "val_loss": 1})] if run.resumed and run.step else []
            settings = "parameters" in dict(run.config)
    else:  # tensorboard: every earlier event hidden; its settings are in their own directory, not hidden
        settings = any((out / PROJECT).glob("*/hparams.yml"))
    return {**_last_steps(rows), "settings": settings}


def _last_steps(rows: list[tuple[int, dict]]) -> dict:
    """The last step of the training records among a tracker's rows (those with an LR, which is never NaN, unlike
    the loss of an interval of skipped steps) and of the validation records."""
    last = lambda key: max((step for step, row in rows if key in row), default=-1)  # noqa: E731
    return {"train": last("lr"), "validation": last("val_loss")}


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
