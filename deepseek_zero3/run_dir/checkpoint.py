"""A run's directory: checkpoints that resume exactly, the exported model, and the settings a resumed run keeps.

    OUT/checkpoints/.tmp-step_N   written by every rank (accelerator.save_state), then renamed by one process per
    OUT/checkpoints/step_N        filesystem to step_N, with trainer_state.json inside; `latest` moves last
    OUT/final                     a plain Hugging Face model directory (gathered from the ZeRO-3 shards)
    OUT/.lock                     held (flock) by one process per machine while a run trains into OUT (resilience.py)

A kill at any moment leaves the last complete checkpoint as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch

from deepseek_zero3.cli import UserError, check_path, fault, resume_policy, remove, replace_dir, write_atomic, write_json_atomic
from deepseek_zero3.model import models, mtp
from deepseek_zero3.run_dir import state as state_lib
from deepseek_zero3.training_data import mixture

# What a checkpoint saved before a setting existed ran with, where that is not the setting's default now.
BEFORE_THE_FIELD = {"document_masking": False, "lr_schedule": "cosine", "mtp_depth": 0, "optimizer": "adamw"}
# Flag values a run resolves and saves resolved (-1: the model's own depth): given again, they mean the run's own.
RESOLVED_BY_THE_RUN = {("mtp_depth", -1), ("optimizer", "auto")}


# ---------------------------------------------------------------------------------------------------------------------
# Before the run: the output directory and what a resumed run keeps
# ---------------------------------------------------------------------------------------------------------------------


MARKER = "train_run.json"  # written into OUT before anything else: the only directories train.py writes into
LOCK = ".lock"  # OUT's lock file: not what makes OUT non-empty or a run's


# How deep a run writes below OUT, in bytes, with room to spare for longer parameter names and step numbers. The
# deepest seen: a universal checkpoint's per-parameter files (reshard.py), 114 bytes for deepseek-v3-tiny's
# checkpoints/step_12.universal/pytorch_model/zero/mtp.0.mtp_block.self_attn.kv_a_proj_with_mqa.weight/exp_avg_sq.pt;
# DeepSpeed's shards 75 (checkpoints/step_10/pytorch_model/zero_pp_rank_2_mp_rank_00_optim_states.pt), W&B's offline
# files 66.
DEPTH_BELOW_OUT = 256


def check_paths(cfg, data_dirs: list[str]) -> None:
    """train.py's path flags, before anything is read or written: what the filesystem or the libraries cannot take is
    refused in one line (cli.check_path), --output_dir with the deepest file a run writes below it."""
    check_path("--output_dir", cfg.output_dir, DEPTH_BELOW_OUT)
    for flag, value in [("--data_dir", d) for d in data_dirs] + [("--resume", cfg.resume), ("--init_from",
                        cfg.init_from), ("--model_config", cfg.model_config)]:  # fmt: skip
        if value and value != "auto":
            check_path(flag, value)


def check_output_dir(output_dir: str, resume: str) -> None:
    """--output_dir and --resume, checked before a checkpoint's settings are read from them."""
    out = Path(output_dir)
    try:
        str(out.absolute()).encode("utf-8")
    except UnicodeEncodeError:  # tokenizers and JSON writers fail on such a path only at the end of the run
        raise UserError(f"--output_dir {output_dir!r} is not valid UTF-8; choose a name in UTF-8") from None
    if out.is_symlink() and not out.exists():
        raise UserError(f"--output_dir {output_dir} is a symlink to {os.readlink(out)}, which does not exist")
    if out.exists() and not out.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file, not a directory; choose a directory")
    for name, kind in ((MARKER, "file"), ("checkpoints", "directory"), ("final", "directory")):
        path = out / name
        if path.exists() and not (path.is_file() if kind == "file" else path.is_dir()):
            raise UserError(f"{path} is not a {kind}, and train.py writes one there; move it away")
    if out.exists() and any(p.name != LOCK for p in out.iterdir()):
        if not resume:
            raise UserError(
                f"--output_dir {output_dir} is not empty; pass --resume auto to continue that run or "
                f"choose an empty directory"
            )
        if not is_train_run(out):
            found = ", ".join(sorted(p.name + "/" * p.is_dir() for p in out.iterdir() if p.name != LOCK)[:6])
            raise UserError(
                f"--output_dir {output_dir} holds {found} but no train.py run (no {MARKER}); --resume continues "
                f"and writes only into directories train.py created: choose an empty or new directory"
            )
    probe = out if out.exists() else next(p for p in out.absolute().parents if p.exists())
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise UserError(f"--output_dir {output_dir}: {probe} is not a writable directory; choose one you can write to")
    if resume not in ("", "auto") and not (Path(resume) / "trainer_state.json").is_file():
        raise UserError(
            f"--resume {resume} is not a complete checkpoint (no trainer_state.json); use --resume auto "
            f"or a checkpoints/step_N directory"
        )


def is_train_run(out: Path) -> bool:
    """Whether OUT was created by train.py: its marker, or (runs from before the marker) train.py's config.json or a
    checkpoint with train.py's trainer_state.json. A folder that merely holds a `checkpoints/` is not enough."""

    def written_by_train_py(path: Path, key: str) -> bool:
        try:
            return key in json.loads(path.read_text())
        except (OSError, ValueError, TypeError):
            return False

    if written_by_train_py(out / MARKER, "written_by") or written_by_train_py(out / "config.json", "written_by"):
        return True
    return any(
        written_by_train_py(p / "trainer_state.json", "model_config_hash") for p in step_dirs(out / "checkpoints")
    )


def mark_train_run(out: Path) -> None:
    """OUT's marker, written once, before train.py writes anything else into OUT."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).is_file():  # a temporary name of its own: each machine's first process may write it at once
        tmp = out / f".{MARKER}.{os.getpid()}-{os.urandom(4).hex()}"
        tmp.write_text(json.dumps({"written_by": "train.py", "created": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        os.replace(tmp, out / MARKER)


def config_for_resume(cfg, flags_given: set[str], saved: dict):
    """The settings of a resumed run: the checkpoint's for every field the command does not give. A command that changes
    a "fixed" setting is refused (each Config field's resume= policy); the schedule's length is checked by
    schedule.schedule_change_on_resume once known. Returns (the run's Config, the settings taken from the checkpoint
    that differ from this command's, the retunable settings this command changes as {name: [the run's, this
    command's]})."""
    taken, changed = {}, {}
    saved = {**BEFORE_THE_FIELD, **saved} if saved else saved
    for f in dataclasses.fields(cfg):
        policy = resume_policy(f)  # train.py's Config says what each policy means
        if f.name not in saved or policy == "own":
            continue
        ours = getattr(cfg, f.name)
        if f.name not in flags_given or (f.name, ours) in RESOLVED_BY_THE_RUN:
            if saved[f.name] != ours:
                taken[f.name] = saved[f.name]
        elif ours != saved[f.name] and policy == "retune":
            changed[f.name] = [saved[f.name], ours]
        elif ours != saved[f.name] and policy == "fixed":
            raise UserError(
                f"cannot resume: the run was trained with {flag(f.name, saved[f.name])}, this command gives "
                f"{flag(f.name, ours)}; drop it to keep the run's setting, or {fresh_start(cfg.output_dir)}"
            )
    return dataclasses.replace(cfg, **taken), taken, changed


def flag(name: str, value) -> str:
    """A setting as the command line spells it: --name value, --name / --no_name for a switch, --name '' for none."""
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no_{name}"
    return f"--{name} {value if value != '' else repr(value)}"


def resume_settings(cfg, flags_given: set[str], resume: Resume, say):
    """config_for_resume for `resume`, saying what it took and what it changed: (the run's Config, the Resume with its
    changes, which metrics.jsonl records)."""
    cfg, taken, changed = config_for_resume(cfg, flags_given, resume.state.get("config", {}))
    if taken:
        say(f"settings from {resume.path.name}: " + " ".join(flag(k, v) for k, v in taken.items()))
    if changed:
        say(f"changed from {resume.path.name}: " + ", ".join(f"--{k} {a} -> {b}" for k, (a, b) in changed.items()))
    return cfg, dataclasses.replace(resume, changed=changed)


def sources_known_as(resume: Resume | None) -> dict | None:
    """The names a checkpoint gave the data's sources, in order, and the data's fingerprint (token_data.training_data's
    known_as); None for a run from before mixtures, or no checkpoint."""
    if resume is None or not isinstance(resume.state.get("data_mix"), dict):
        return None
    return {"names": list(resume.state["data_mix"]), "fingerprint": resume.state.get("data_fingerprint")}


def adopt_source_names(cfg, resume: Resume | None, renamed: dict[str, str], say):
    """A checkpoint whose train.py named sources by their directories (DIRECTORY/name), of the same data: its names
    in trainer_state.json's data_mix and in the run's --data_mix become today's (renamed: TrainingData.renamed), so
    the identity compares the same sources. Returns (the run's Config, the Resume)."""
    if not renamed:
        return cfg, resume
    say("sources named by position: " + ", ".join(f"{old} -> {new}" for old, new in renamed.items()))
    mix = {renamed.get(name, name): weight for name, weight in resume.state["data_mix"].items()}
    resume = dataclasses.replace(resume, state={**resume.state, "data_mix": mix})
    return dataclasses.replace(cfg, data_mix=mixture.renamed(cfg.data_mix, renamed)), resume


def fresh_start(output_dir) -> str:
    """The advice for a setting no resume can change: a new run, from OUT/final's weights where there are any."""
    final = Path(output_dir) / "final"
    if (final / "config.json").is_file():
        return f"start a new --output_dir with --init_from {final} (its weights; a fresh optimizer and schedule)"
    return "start a new --output_dir (this run has no final/ model to --init_from yet)"


def config_hash(model_config) -> str:
    """What identifies a model's architecture in trainer_state.json: its config without names and versions."""
    architecture = json.dumps(models.architecture(model_config), sort_keys=True, default=str)
    return hashlib.sha256(architecture.encode()).hexdigest()[:16]


def read_model_config(ckpt: Path):
    """The model config a checkpoint was trained with (saved beside its shards): a resume needs nothing else."""
    where = str(ckpt / "model_config.json")
    d = models.read_config_json(ckpt / "model_config.json", where)
    models.check_model_fields(d, where)
    return models.build_model_config(d, where)


def check_resume_compatible(state: dict, current: dict, ckpt: Path) -> None:
    """A checkpoint only continues the same run: ZeRO-3 shards are per rank, the data order and schedule depend on
    the global batch, sequence length, data and seed, and DeepSpeed's files are named by precision. Keys a checkpoint
    from an older train.py lacks are not compared."""
    for key, value in current.items():
        if key in state and state[key] != value:
            where = {"precision": " (the accelerate config's mixed_precision, or --mixed_precision at launch)",
                     "zero_stage": " (the accelerate config's strategy)"}.get(key, "")  # fmt: skip
            relaunch = "relaunch with the original setting"
            if key == "precision":  # accelerate launch's own spelling of the run's precision
                relaunch = f"relaunch with --mixed_precision {'no' if state[key] == 'fp32' else state[key]} after " \
                           f"accelerate launch's --config_file"  # fmt: skip
            raise UserError(
                f"cannot resume {ckpt}: it was made with {key}={state[key]!r}, this run has "
                f"{key}={value!r}{where}; {relaunch}, or {fresh_start(ckpt.parent.parent)}"
            )


# ---------------------------------------------------------------------------------------------------------------------
# Finding the checkpoint to resume from
# ---------------------------------------------------------------------------------------------------------------------


STEP_N = r"step_(0|[1-9][0-9]*)"  # exactly what save_checkpoint writes: no step_04, no other digits
STEP_DIR = re.compile(STEP_N)
LEFTOVER = re.compile(rf"\.tmp-{STEP_N}(?:\.universal)?|\.{STEP_N}(?:\.universal)?\.stale|\.rank0-[0-9a-f]{{16}}")
UNIVERSAL = re.compile(rf"{STEP_N}\.universal")  # reshard.py's copy of step_N, gone with step_N
ABANDONED = re.compile(r"abandoned-[0-9]{8}-[0-9]{6}(?:-[0-9]+)?")


def step_of(path: Path) -> int | None:
    """N of a `step_N` directory name; None for any other name (a user's step_2.bak is not a checkpoint)."""
    match = STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def step_dirs(ckpt_root: Path) -> list[Path]:
    """The step_N directories, oldest first, complete or not; other names are never parsed or touched."""
    if not ckpt_root.is_dir():
        return []
    found = (p for p in ckpt_root.iterdir() if p.is_dir() and not p.is_symlink() and step_of(p) is not None)
    return sorted(found, key=step_of)


def write_manifest(ckpt: Path) -> None:
    """manifest.json: every file of the checkpoint with its size, written last, so a checkpoint that lost or truncated
    a shard afterwards (a full disk, a partial copy, a user's rm) is recognised before DeepSpeed reads it."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
    write_json_atomic(ckpt / "manifest.json", {"files": {str(p.relative_to(ckpt)): p.stat().st_size for p in files}})


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (None: it is intact). Checkpoints from before manifests are taken on
    their trainer_state.json alone."""
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
    except FileNotFoundError:
        return "no trainer_state.json (a run died while writing it)"
    except (OSError, ValueError) as e:
        return f"trainer_state.json is unreadable ({type(e).__name__})"
    problem = state_problem(state, step_of(ckpt))
    if problem is not None:
        return f"trainer_state.json {problem}"
    manifest = ckpt / "manifest.json"
    if not manifest.exists():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
        files = {str(name): int(size) for name, size in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "manifest.json is unreadable"
    for name, size in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
    return None


def state_problem(state, step: int | None) -> str | None:
    """What is wrong with a trainer_state.json's content for resuming from step_N (None: nothing)."""
    if not isinstance(state, dict):
        return "is not a JSON object"
    for key in ("step", "total_steps", "tokens_seen"):
        if not isinstance(state.get(key), int) or isinstance(state.get(key), bool) or state[key] < 0:
            return f"has no valid {key}"
    if step is not None and state["step"] != step:
        return f"says step {state['step']}, not {step} (a copy under another name?)"
    if not isinstance(state.get("config", {}), dict):
        return "has no valid config"
    return None


def read_trainer_state(ckpt: Path) -> dict:
    problem = checkpoint_problem(ckpt)
    if problem is not None:
        older = [p.name for p in step_dirs(ckpt.parent) if p != ckpt and checkpoint_problem(p) is None]
        fix = f"resume from {ckpt.parent / older[-1]}" if older else "start a new --output_dir"
        raise UserError(f"cannot resume {ckpt}: {problem}; {fix}")
    return json.loads((ckpt / "trainer_state.json").read_text())


def newest_intact_checkpoint(ckpt_root: Path, say) -> Path | None:
    """What `--resume auto` continues on this machine: the newest checkpoint that verifies; each newer one that does
    not is named with the reason and left where it is."""
    for ckpt in reversed(step_dirs(ckpt_root)):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        say(f"warning: skipping checkpoint {ckpt}: {problem}")
    return None


@dataclasses.dataclass(frozen=True)
class Resume:
    """The checkpoint a run continues from and its trainer_state.json; `branch`, what the checkpoints this run writes
    record as theirs (trainer_state.json "branch": the checkpoint an explicit --resume started them from, and its
    step); `named`, the checkpoint an explicit --resume names (pruning keeps it: the same command may come again)."""

    path: Path
    state: dict
    changed: dict = dataclasses.field(default_factory=dict)  # config_for_resume's: recorded in metrics.jsonl
    branch: dict | None = None
    named: Path | None = None

    @property
    def branching(self) -> bool:
        """Whether this run starts a branch at the checkpoint --resume names (OUT's newer checkpoints move aside)."""
        return self.named is not None and self.path == self.named

    @property
    def kept(self) -> tuple[Path, ...]:
        """What pruning never deletes: the checkpoint resumed from, and the one the command names."""
        return (self.path,) if self.named is None else (self.path, self.named)


def find_resume_checkpoint(resume: str, ckpt_root: Path, accelerator, own_work: bool = True) -> Resume | None:
    """The checkpoint to resume from, the same on every rank. With node-local disks each machine sees only its own
    copies, and a kill between two machines' renames leaves them at different steps: all take the oldest.
    own_work: an explicit --resume weighs OUT's own checkpoints (explicit_resume); False for a decay branch, whose
    first launch refuses an OUT holding any (schedule.branch_settings)."""
    for partial in sorted(p for p in ckpt_root.glob(".tmp-step_*") if not UNIVERSAL.fullmatch(p.name[5:])):
        accelerator.print(f"warning: ignoring incomplete checkpoint {partial} (a run died while writing it)")
    if resume not in ("", "auto"):
        if copy := UNIVERSAL.fullmatch(Path(resume).name):  # reshard.py's, for a resume on another world size
            original = Path(resume).parent / f"step_{copy.group(1)}"
            raise UserError(f"--resume {resume}: train.py's universal copy of a checkpoint; --resume {original}")
        named = Path(resume)
        state = read_trainer_state(named)  # refuses a damaged checkpoint before anything moves or loads
        branch = {"from": str(named.resolve()), "step": state["step"]}
        if not own_work:
            return Resume(named, state, branch=branch, named=named)
        return explicit_resume(named, state, branch, ckpt_root, accelerator)
    if resume != "auto":
        return None
    mine = newest_intact_checkpoint(ckpt_root, accelerator.print)
    step = step_of(mine) if mine is not None else -1
    all_damaged = int(mine is None and bool(step_dirs(ckpt_root)))
    lowest, highest = step, step
    if accelerator.num_processes > 1:
        steps = torch.tensor([step, -step, -all_damaged], device=accelerator.device)
        torch.distributed.all_reduce(steps, op=torch.distributed.ReduceOp.MIN)
        lowest, highest, all_damaged = int(steps[0]), -int(steps[1]), -int(steps[2])
    if highest < 0 and all_damaged:
        raise UserError(
            f"--resume auto: no checkpoint in {ckpt_root} is intact (see the warnings above), and starting over "
            f"would replace this run's metrics and model; resume one by hand with --resume, or start a new "
            f"--output_dir"
        )
    if highest < 0:
        return None
    if lowest < 0:
        raise UserError(
            f"--resume auto: some machines have no complete checkpoint in {ckpt_root} while others reach "
            f"step {highest}; copy the checkpoints to every machine or start a new --output_dir"
        )
    if lowest != highest:
        accelerator.print(
            f"warning: machines disagree on the newest checkpoint (steps {lowest} to {highest}); "
            f"all resume from step {lowest}"
        )
    chosen = ckpt_root / f"step_{lowest}"
    missing = torch.tensor([float(checkpoint_problem(chosen) is not None)], device=accelerator.device)
    if float(accelerator.reduce(missing, "sum")) > 0:
        raise UserError(
            f"--resume auto: {chosen} is not complete on every machine; copy it there or resume from an "
            f"older checkpoint"
        )
    state = read_trainer_state(chosen)
    return Resume(chosen, state, branch=state.get("branch"))


def explicit_resume(named: Path, state: dict, branch: dict, ckpt_root: Path, accelerator) -> Resume:
    """--resume DIR starts a branch at DIR (`branch`, recorded by every checkpoint this run writes), unless OUT
    (ckpt_root's parent) holds newer work that must not be lost:
    - OUT's newest checkpoint continues this very branch (an earlier launch of the same command, stopped: a requeued
      job): the run continues from it, as --resume auto would, and nothing moves;
    - DIR is one of OUT's own, older than others (going back, e.g. before a loss spike): a branch; the newer ones move
      to checkpoints/abandoned-*/ once DIR has loaded (set_aside_newer), kept until the user deletes them;
    - DIR lies outside OUT (another run's checkpoint, or a copy) and OUT holds checkpoints of another line: refused
      (resuming there would set them aside, or mix two runs in one directory), nothing touched."""
    own = newest_intact_checkpoint(ckpt_root, lambda _: None)
    own_state = read_trainer_state(own) if own is not None else {}
    inside = named.parent.resolve() == ckpt_root.resolve()
    if own is not None and own_state.get("branch") == branch and own_state["step"] > state["step"]:
        decision = f"continue {own.name}"
    elif own is None or inside:
        decision = "branch"
    else:
        decision = f"refuse {own.name}"
    if accelerator.num_processes > 1:  # node-local disks: every machine must come to the same decision
        from accelerate.utils import gather_object

        if len(set(gather_object([decision]))) > 1:
            raise UserError(
                f"--resume {named}: the machines hold different checkpoints in {ckpt_root}; copy them to every "
                f"machine, or continue with --resume auto"
            )
    out = ckpt_root.parent
    if decision.startswith("refuse"):
        raise UserError(
            f"--resume {named}: --output_dir {out} holds checkpoints of its own (newest {own.name}) that do not "
            f"continue from it, and resuming it there would set them aside or mix two runs; continue {out} with "
            f"--resume auto, or start from {named} in a new --output_dir"
        )
    if decision.startswith("continue"):
        again = (f"to go back to {named.name} again, first move the checkpoints after it out of {ckpt_root}" if inside
                 else f"to start from {named} anew, give a new --output_dir")  # fmt: skip
        accelerator.print(
            f"{own} continues the branch from {named} (an earlier launch of this command): resuming from it, as "
            f"--resume auto would; {again}"
        )
        return Resume(own, own_state, branch=branch, named=named)
    return Resume(named, state, branch=branch, named=named)


def set_aside_newer(ckpt_root: Path, resume_from: Path, step: int) -> str | None:
    """An explicit --resume from an older checkpoint starts a new branch: this run's checkpoints after it (ckpt_root:
    OUT/checkpoints) move to a new checkpoints/abandoned-<time>/ (out of pruning's and --resume auto's way, kept until
    the user deletes it) with a copy of OUT/metrics.jsonl (the branch's history, which the resume cuts back), and
    `latest` names resume_from when it is one of them (at `step`, from its trainer_state.json: a user's copy may have
    any name), else the newest left. Called only once resume_from has loaded. Returns a line saying what moved where."""
    if not ckpt_root.is_dir():
        return None
    inside = resume_from.parent.resolve() == ckpt_root.resolve()
    newer = [p for p in step_dirs(ckpt_root) if step_of(p) > step and not (inside and p.name == resume_from.name)]
    if not newer:
        return None
    aside = new_dir(ckpt_root, time.strftime("abandoned-%Y%m%d-%H%M%S"))
    if (ckpt_root.parent / "metrics.jsonl").is_file():
        shutil.copyfile(ckpt_root.parent / "metrics.jsonl", aside / "metrics.jsonl")
    for p in newer:
        os.replace(p, aside / p.name)
        remove(p.with_name(f"{p.name}.universal"))  # reshard.py's copy: another branch's weights
    left = step_dirs(ckpt_root)
    if inside or left:
        write_atomic(ckpt_root / "latest", (resume_from if inside else left[-1]).name + "\n")
    else:
        (ckpt_root / "latest").unlink(missing_ok=True)
    return (
        f"moved the checkpoints after {resume_from.name} ({', '.join(p.name for p in newer)}) to {aside} (with a copy "
        f"of metrics.jsonl; kept until you delete it): this run continues from {resume_from.name}"
    )


def new_dir(parent: Path, name: str) -> Path:
    """A directory created under `name`, or name-2, name-3, ... where that is taken: the name of an older one (a clock
    set back, two in one second) never mixes the two."""
    for n in range(1, 10_000):
        path = parent / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"{parent / name}-2 to -9999 are all taken", str(parent / name))


def remove_leftovers(ckpt_root: Path) -> list[str]:
    """What earlier runs in OUT left that nothing will read: half-written checkpoints (.tmp-step_N), old copies a
    crash left beside their replacement (.step_N.stale, when step_N is there), markers of crashed starts. The branches
    an explicit --resume set aside are the user's to delete. Returns the names removed."""
    if not ckpt_root.is_dir():
        return []
    doomed = []
    for p in ckpt_root.iterdir():
        match = LEFTOVER.fullmatch(p.name)
        orphan = UNIVERSAL.fullmatch(p.name) and not (ckpt_root / p.name.removesuffix(".universal")).is_dir()
        if orphan or (match and (match.group(2) is None or (ckpt_root / f"step_{match.group(2)}").is_dir())):
            doomed.append(p)
    for p in doomed:
        remove(p)
    return sorted(p.name for p in doomed)


def set_aside(ckpt_root: Path) -> list[Path]:
    """The branches explicit resumes set aside in ckpt_root (set_aside_newer), oldest name first."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if ABANDONED.fullmatch(p.name) and p.is_dir() and not p.is_symlink())


def first_process_on_disk(accelerator, directory: Path) -> bool:
    """True on exactly one process per filesystem holding `directory`: global rank 0, and on node-local disks (where
    rank 0's marker file is invisible) the first process of each other machine. These processes finalise checkpoints."""
    from accelerate.utils import broadcast_object_list

    nonce = broadcast_object_list([os.urandom(8).hex()])[0]
    marker = directory / f".rank0-{nonce}"
    if accelerator.is_local_main_process:
        directory.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        marker.touch()
    accelerator.wait_for_everyone()
    sees_rank0 = marker.exists()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        marker.unlink()
    return accelerator.is_main_process or (accelerator.is_local_main_process and not sees_rank0)


# ---------------------------------------------------------------------------------------------------------------------
# Writing: checkpoints, the metrics a resumed run keeps, the final model
# ---------------------------------------------------------------------------------------------------------------------


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (exit 3): the message names the directory, the likely cause and the fix."""


# How a collective says that another process died (gloo, NCCL): that process prints why; this one only follows it.
PEER_FAILED = ("closed by peer", "reset by peer", "remote process exited")


def write_failure(tmp: Path, error: BaseException, last_good: Path | None,
                  what: str = "checkpoint") -> CheckpointWriteError:  # fmt: skip
    import resource

    keep = f"the last complete checkpoint, {last_good}, is intact" if last_good else "no earlier checkpoint exists"
    if any(words in str(error) for words in PEER_FAILED):
        failure = CheckpointWriteError(
            f"another process failed while {what} {tmp} was written (its error line says why); {keep}: fix "
            f"what it names, then rerun with --resume auto"
        )
        failure.follows_another = True  # said after a pause, so that the failed process's own line comes alone
        return failure

    if too_long(error):  # not a full disk: freeing space would not help
        return CheckpointWriteError(
            f"writing {what} {tmp} failed: {type(error).__name__}: {error}; {keep}: {fix_for(error)}, then rerun "
            f"with --resume auto"
        )
    free_gib = shutil.disk_usage(tmp if tmp.exists() else tmp.parent).free / 2**30
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    why = f"{free_gib:.1f} GiB free on that disk" + (
        f", file size limit (ulimit -f) {limit} bytes" if limit != resource.RLIM_INFINITY else ""
    )
    return CheckpointWriteError(
        f"writing {what} {tmp} failed: {type(error).__name__}: {error} ({why}); {keep}: free space or raise "
        f"the limit, then rerun with --resume auto"
    )


def too_long(error: BaseException) -> bool:
    """Whether a write failed for a name or path past the filesystem's limit (torch and safetensors report it in
    their own exception types, with the system's words)."""
    return getattr(error, "errno", None) == errno.ENAMETOOLONG or os.strerror(errno.ENAMETOOLONG) in str(error)


def fix_for(error: BaseException) -> str:
    """What to do about a failed write of the run's (train.py's last words on an OSError)."""
    if too_long(error):
        return ("a path in OUT is past the filesystem's limit: move the run directory to a shorter path and give "
                "that as --output_dir")  # fmt: skip
    return "fix it"


@dataclasses.dataclass(frozen=True)
class Save:
    """A checkpoint to write: where, at which step, its trainer_state.json and model config, how many to keep, and the
    state it holds beside the model and optimizer (train.py's checkpoint_state: run_dir/state.py saves it)."""

    ckpt_root: Path
    step: int
    state: dict
    model_config: object
    keep_last: int
    pieces: dict = dataclasses.field(default_factory=dict)


def save_checkpoint(accelerator, save: Save, kept: tuple[Path, ...], finalises_checkpoints: bool) -> Path:
    """Every rank writes its shards into .tmp-step_N; once all have, the process that finalises checkpoints on each
    filesystem (finalises_checkpoints: first_process_on_disk) adds trainer_state.json, the model config and the
    manifest, renames it to step_N, moves `latest` and prunes (never those in `kept`: Resume.kept). Raises
    CheckpointWriteError, with step_N untouched, when the disk refuses a write."""
    ckpt_root, step = save.ckpt_root, save.step
    final = ckpt_root / f"step_{step}"
    tmp = ckpt_root / f".tmp-step_{step}"
    last_good = newest_intact_checkpoint(ckpt_root, lambda _: None)  # on every rank: each says the same if it fails
    try:
        if finalises_checkpoints:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while writing this step
            tmp.mkdir(parents=True, exist_ok=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        state_lib.save(tmp, save.pieces, accelerator, finalises_checkpoints)
        fault("sigkill_in_save", accelerator.process_index, step)
        fault("sigterm_in_save", accelerator.process_index, step)
        if fault("enospc_in_save", accelerator.process_index, step):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
        accelerator.wait_for_everyone()
        if finalises_checkpoints:
            write_json_atomic(tmp / "trainer_state.json", save.state)
            save.model_config.to_json_file(tmp / "model_config.json")
            write_manifest(tmp)
            replace_dir(tmp, final)  # a step_N of an earlier attempt at this step is replaced whole
            write_atomic(ckpt_root / "latest", final.name + "\n")
    except Exception as e:  # noqa: BLE001 - torch says "basic_ios::clear: iostream error", safetensors SafetensorError
        raise write_failure(tmp, e, last_good) from None
    # Keep the newest keep_last intact checkpoints; damaged ones before them can never be resumed.
    if finalises_checkpoints:
        everything = step_dirs(ckpt_root)
        intact = [p for p in everything if checkpoint_problem(p) is None]
        keep = set(intact[-save.keep_last :]) | {final}
        for old in everything:
            if old not in keep and step_of(old) < step and old.resolve() not in {p.resolve() for p in kept}:
                shutil.rmtree(old, ignore_errors=True)
                shutil.rmtree(old.with_name(f"{old.name}.universal"), ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(run, training, pieces: dict, universal: Path | None = None) -> None:
    """Load the checkpoint run.resume names (run, training: train.py's RunSettings and TrainingObjects), or its
    universal form (reshard.py), and the state it holds beside them into `pieces` (train.py's checkpoint_state; always
    from the checkpoint itself: run_dir/state.py reshards it). Only once it has loaded does an explicit --resume from an
    older checkpoint move the newer ones aside, so a failed load changes nothing."""
    path = run.resume.path
    try:
        training.accelerator.load_state(str(universal or path))
        # Accelerate's micro-step count ends each step's accumulation: in this launch's (a resume may change it).
        training.accelerator.step = run.resume.state["step"] * run.launch.grad_accum_steps
    except Exception as e:  # noqa: BLE001 - DeepSpeed and torch raise many kinds for one damaged file
        first_line = str(e).strip().splitlines()[:1]  # a bare assert (DeepSpeed has many) has no message at all
        why = f"{type(e).__name__}: {first_line[0][:300]}" if first_line else type(e).__name__
        older = f"resume from an older checkpoint with --resume {path.parent}/step_N"
        fix = f"delete it: {path.name} is converted anew at the next start" if universal else older
        raise UserError(f"cannot load checkpoint {universal or path}: {why}; {fix}") from None
    state_lib.load(path, pieces, training.accelerator, training.accelerator.print)
    if run.resume.branching and training.finalises_checkpoints:
        # This run's own checkpoints only: another run's checkpoint, resumed into a new OUT, leaves that run as it was.
        moved = set_aside_newer(Path(run.cfg.output_dir) / "checkpoints", path, run.resume.state["step"])
        if moved is not None:
            print(moved)
    training.accelerator.print(
        f"resumed from {path} at step {run.resume.state['step']} ({run.resume.state['tokens_seen']:,} tokens seen)"
    )


def export_final(accelerator, model, tokenizer, out_dir: Path, name: str = "final", weights=None) -> Path:
    """OUT/final: a plain Hugging Face model directory of the main network, weights gathered from the ZeRO-3 shards;
    MTP modules beside it in mtp.safetensors (DeepSeek-V3's layout: mtp.export_weights), their number in a DeepSeek-V3
    config's num_nextn_predict_layers. `weights` ({parameter name: whole tensor}, on the main process: an EMA's) take
    the place of the model's own parameters, in their dtype, and `name` the place of final."""
    from safetensors.torch import save_file

    state_dict = accelerator.get_state_dict(model)  # collective: every rank takes part
    if weights and accelerator.is_main_process:
        state_dict = {k: weights[k].to(v.dtype) if k in weights else v for k, v in state_dict.items()}
    final, tmp = out_dir / name, out_dir / f".tmp-{name}"
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            fault("fsize_in_export", accelerator.process_index, 0)
            unwrapped = accelerator.unwrap_model(model)
            main, own = mtp.split_state_dict(state_dict)
            saved_config = copy.deepcopy(unwrapped.config)
            dtypes = {t.dtype for t in main.values() if t.is_floating_point()}
            if len(dtypes) == 1:  # the weights' (a 16-bit run's are 16-bit), not the fp32 the model was built in
                saved_config.dtype = dtypes.pop()
            if hasattr(saved_config, "num_mtp_layers"):  # transformers' name for it; 1 unless set
                saved_config.num_mtp_layers = len(mtp.modules_of(unwrapped) or [])
            unwrapped.save_pretrained(tmp, state_dict=main, safe_serialization=True)
            saved_config.save_pretrained(tmp)
            if own:
                save_file(mtp.export_weights(unwrapped, state_dict), tmp / mtp.EXPORT_FILE, {"format": "pt"})
            tokenizer.save_pretrained(tmp)
            replace_dir(tmp, final)
        accelerator.wait_for_everyone()
    except Exception as e:  # noqa: BLE001 - a full or read-only disk: OSError, or safetensors' SafetensorError
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        last_good = newest_intact_checkpoint(out_dir / "checkpoints", lambda _: None)
        raise write_failure(tmp, e, last_good, what="the final model to") from None
    return final
