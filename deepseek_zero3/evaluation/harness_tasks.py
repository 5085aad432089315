"""Downstream tasks (HellaSwag, ARC, ...) through lm-evaluation-harness's own Python API and task definitions: its
TaskManager finds and builds the tasks (its registry plus --include_path), its HF model class (HFLM) wraps the model
eval.py built, and simple_evaluate scores it. Nothing here reimplements a task or a metric.

    task_names      "core,piqa" -> the task names, the `core` preset expanded
    load_tasks      names -> the harness's built tasks; an unknown name or a dataset out of reach refused in one line
    run_tasks       the harness's results for a model, as `lm_eval --model hf` gives them on the same model
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import re
from pathlib import Path

from deepseek_zero3.cli import UserError

# `--tasks core`: six of the tasks base-model reports (GPT-3's onwards) most often show zero-shot. All are scored by
# log-likelihood (no generation settings to match) and cover science questions (ARC), commonsense (HellaSwag, PIQA),
# coreference (Winogrande) and long-range word prediction (LAMBADA). Their data are Hub datasets.
CORE_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "lambada_openai")
# What HFLM warns when handed a built model: that it runs on one process, which eval.py makes sure of.
HFLM_NOISE = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model")


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """What the harness is asked: the tasks, where local task definitions are, shots, examples per task, batch size."""

    names: tuple[str, ...]
    include_path: str = ""
    num_fewshot: int = -1  # -1: each task's own setting
    limit: float = 0  # 0: every example; below 1 a fraction, as the harness's --limit
    batch_size: int = 1


def task_names(tasks: str) -> tuple[str, ...]:
    """The names in a comma-separated --tasks value, `core` expanded, each once, in order."""
    names = []
    for name in (t.strip() for t in tasks.split(",")):
        for n in CORE_TASKS if name == "core" else (name,):
            if n and n not in names:
                names.append(n)
    if not names:
        raise UserError(f"--tasks {tasks!r} names no task; e.g. --tasks core or --tasks hellaswag,arc_easy")
    return tuple(names)


def task_manager(include_path: str, names: tuple[str, ...] = ()):
    """The harness's task registry, with the task definitions of --include_path (which take precedence). When every
    name is a task of --include_path's own (not a group or a tag, which may name the harness's tasks), that directory's
    registry alone: the harness's index reads its ~14,700 task YAML files, 9-12 s on a 2-core AMD EPYC."""
    if include_path and not Path(include_path).is_dir():
        raise UserError(f"--include_path {include_path} is not a directory; pass the directory of your task YAML files")
    include_path = str(Path(include_path).resolve()) if include_path else ""
    if include_path and names:
        own = _task_manager(include_path, defaults=False)
        if set(names) <= set(own.all_subtasks):  # the harness's name for tasks, not groups or tags
            return own
    return _task_manager(include_path)


@functools.lru_cache(maxsize=8)
def _task_manager(include_path: str, defaults: bool = True):
    """Kept per directory within a process: building the index reads every task YAML file under it."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path or None, include_defaults=defaults)


def unknown_task_error(names: list[str], manager, include_path: str) -> UserError:
    """One line for every unknown name, each with its close matches."""
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
        hints.append(f"{name}: did you mean {', '.join(close)}?" if close else f"{name}: nothing close")
    where = f"lm-evaluation-harness or {include_path}" if include_path else "lm-evaluation-harness"
    return UserError(
        f"--tasks {','.join(names)}: no task, group or tag of {'that name' if len(names) == 1 else 'these names'} in "
        f"{where} ({'; '.join(hints)}); lm_eval --tasks list prints them all (a task of your own: its YAML file in a "
        f"directory passed with --include_path)"
    )


def dataset_name(name: str, manager) -> str:
    cfg = getattr(manager.task_index.get(name), "cfg", None) or {}
    dataset = str(cfg.get("dataset_path", ""))
    return dataset + f" ({cfg['dataset_name']})" if dataset and cfg.get("dataset_name") else dataset or "its dataset"


def failure(error: BaseException) -> tuple[str, str]:
    """(kind, what happened) of a task whose dataset could not be loaded: kind "hub" (not cached and the Hub out of
    reach), "files" (a data file of the task's YAML missing, matching nothing, or not parseable) or "other"."""
    text = str(error).splitlines()[0][:200] if str(error) else ""
    if isinstance(error, ConnectionError) or "Couldn't reach" in text:
        return "hub", f"not cached, and the Hub out of reach: {text}"
    found = re.search(r"Unable to find '([^']*)'", text) if isinstance(error, FileNotFoundError) else None
    if found:
        return "files", f"no file {found[1]}"
    if isinstance(error, StopIteration):  # what datasets raises for a data_files pattern that matches nothing
        return "files", "no file matches its data_files"
    cause = error.__cause__ or error.__context__
    if type(error).__name__ == "DatasetGenerationError" and cause is not None:  # a local file that does not parse
        reason = str(cause).splitlines()[0][:200] if str(cause) else ""
        return "files", f"a data file cannot be parsed ({type(cause).__name__}: {reason})"
    return "other", f"{type(error).__name__}: {text}"


FIXES = {
    "hub": "run this once where the Hub is reachable, with HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0, to cache them, or "
    "copy the data to local files and define the tasks over them in YAML files under --include_path DIR",
    "files": "check dataset_path and data_files in the task's YAML under --include_path (names are relative to "
    "dataset_path when it is a directory) and the files themselves",
    "other": "check the tasks' dataset_path and data_files, or pass tasks of your own with --include_path DIR",
}


def dataset_error(failed: dict[str, BaseException], manager) -> UserError:
    """The one line for every task whose dataset cannot be loaded: which dataset, what happened, how to fix it."""
    found = {name: failure(e) for name, e in failed.items()}
    which = "; ".join(f"{name}: {dataset_name(name, manager)}: {what}" for name, (_, what) in found.items())
    kinds = dict.fromkeys(kind for kind, _ in found.values())  # in order, once each
    return UserError(f"--tasks: datasets cannot be loaded ({which}); {'; '.join(FIXES[k] for k in kinds)}")


def load_tasks(settings: TaskSettings):
    """The harness's TaskManager and the tasks it builds for the names, datasets loaded. Each name is loaded on its own
    so that every dataset that cannot be loaded is named, with its task, in the one error line."""
    manager = task_manager(settings.include_path, settings.names)
    unknown = [name for name in settings.names if name not in manager.task_index]
    if unknown:
        raise unknown_task_error(unknown, manager, settings.include_path)
    built, failed = [], {}
    for name in settings.names:
        try:
            loaded = manager.load([name])
        except Exception as e:  # noqa: BLE001 - datasets raises ConnectionError, FileNotFoundError, StopIteration, ...
            failed[name] = e
            continue
        if name in loaded["groups"]:
            built.append(loaded["groups"][name])
        else:  # a task, or a tag: the tasks it names
            built.extend(loaded["tasks"].values())
    if failed:
        raise dataset_error(failed, manager)
    return manager, built


class _DropHflmNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(noise in record.getMessage() for noise in HFLM_NOISE)


def run_tasks(model, tokenizer, settings: TaskSettings, loaded) -> dict:
    """simple_evaluate on the model through the harness's HF model class: the dict `lm_eval` writes as its results
    JSON (results, n-shot, versions, n-samples, ...). `loaded` is what load_tasks returned."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    manager, tasks = loaded
    quiet = _DropHflmNoise()
    hf_log = logging.getLogger("lm_eval.models.huggingface")
    hf_log.addFilter(quiet)
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size)
    finally:
        hf_log.removeFilter(quiet)
    try:
        return simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=None if settings.num_fewshot < 0 else settings.num_fewshot,
            limit=settings.limit or None,
            task_manager=manager,
            log_samples=False,
        )
    except ValueError as e:  # the harness samples the examples without replacement
        if "Sample larger than population" not in str(e):
            raise
        raise UserError(
            f"--num_fewshot {settings.num_fewshot} is more examples than a task's few-shot split holds; lower it"
        ) from None


def task_report(results: dict, settings: TaskSettings) -> dict:
    """What eval.py's JSON report keeps of the harness's results: its per-task metrics as its own results JSON names
    them ("acc,none", "acc_norm,none", ...), per-group ones, and what they were run with; plain JSON values only."""
    report = {
        "tasks": results["results"],
        **({"groups": results["groups"]} if results.get("groups") else {}),
        "task_settings": {
            "include_path": settings.include_path,
            "num_fewshot": results.get("n-shot", {}),
            "limit": settings.limit or None,
            "batch_size": settings.batch_size,
            "n_samples": results.get("n-samples", {}),
            "versions": results.get("versions", {}),
            "higher_is_better": results.get("higher_is_better", {}),
            "group_subtasks": results.get("group_subtasks", {}),
            "lm_eval_version": results.get("lm_eval_version"),
        },
    }
    # A task's own metric may hand back a numpy number: JSON gets its value.
    return json.loads(json.dumps(report, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def results_table(report: dict) -> str:
    """The harness's own table (what `lm_eval` prints) of the results task_report keeps."""
    from lm_eval.utils import make_table

    settings = report["task_settings"]
    results = {
        "results": report["tasks"],
        "groups": report.get("groups", {}),
        "versions": settings["versions"],
        "n-shot": settings["num_fewshot"],
        "higher_is_better": settings["higher_is_better"],
        "group_subtasks": settings["group_subtasks"],
    }
    table = make_table(results)
    return table + ("\n" + make_table(results, "groups") if results["groups"] else "")
