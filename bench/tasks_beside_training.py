"""What scoring downstream tasks beside a run costs the run (issue #27, part 3): train.py's tokens/s alone and with
eval.py scoring one of its checkpoints on a task in another process, back to back, for the whole run.

    python bench/tasks_beside_training.py [--model_config mini] [--steps 40] [--rounds 2]

train.py: 3 CPU processes under accelerate_configs/zero3_cpu.yaml, python-docs with a BPE of 8192, 4 x 128 tokens
per process and step, steady-state tokens/s (the log intervals after the first). Beside it, in the second of each
round's two runs: `python eval.py --model CKPT --tasks local_mc --include_path DIR` in a loop until the run ends, CKPT
a ZeRO-3 checkpoint of the same preset (written first, by a 2-step run) and local_mc a 16-question multiple-choice task
over held-out documents of the data (written here). The row is the ratio of the two rates; eval.py's seconds per
scoring are beside it. This is the CPU case: a side process that scores a checkpoint on the cores the training
processes use. A GPU machine whose every GPU trains is the same case for the host's cores or a GPU's compute; a
spare GPU is not (not measured: no GPU here).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, free_port, held_out_words, multiple_choice_rows, prepare_docs, record, sh, train_py_rate

TASK_YAML = """task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(data: Path, directory: Path) -> Path:
    """local_mc: the first 10 words of a held-out document, then its next 6 words among 3 other documents'."""
    rows = multiple_choice_rows(held_out_words(data))
    directory.mkdir(parents=True)
    (directory / "local_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "local_mc.yaml").write_text(TASK_YAML.format(data=(directory / "local_mc.jsonl").resolve()))
    return directory


def score_until(stop: threading.Event, ckpt: Path, tasks: Path, seconds: list) -> None:
    """eval.py on the checkpoint and task, again and again until `stop`; the seconds of each finished scoring."""
    cmd = [sys.executable, "eval.py", "--model", str(ckpt), "--tasks", "local_mc", "--include_path", str(tasks)]
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tasks / "cache")}
    while not stop.is_set():
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        while proc.poll() is None:
            if stop.wait(0.2):
                proc.kill()
                proc.wait()
                return
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout.read()[-3000:]}")
        seconds.append(time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_config", default="mini")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prepare_docs(str(tmp))
        tasks = write_task(data, tmp / "tasks")
        launcher = lambda: ["accelerate", "launch", "--config_file", "accelerate_configs/zero3_cpu.yaml",
                            "--num_processes", "3", "--main_process_port", str(free_port())]  # fmt: skip
        first = tmp / "scored"
        sh(launcher() + ["train.py", "--data_dir", str(data), "--output_dir", str(first), "--model_config",
                         args.model_config, "--seq_len", "128", "--micro_batch_size", "4",
                         "--max_steps", "2", "--optimizer", "adamw"])  # fmt: skip
        ckpt = first / "checkpoints" / "step_2"
        alone, beside, scoring_s = [], [], []
        for r in range(args.rounds):
            for side in (False, True):
                stop, seconds = threading.Event(), []
                scorer = threading.Thread(target=score_until, args=(stop, ckpt, tasks, seconds))
                if side:
                    scorer.start()
                run = train_py_rate(launcher(), data, tmp / f"run{r}{side}", args.model_config, 128, 4, args.steps, 3,
                                    intervals=4)  # fmt: skip
                stop.set()
                if side:
                    scorer.join()
                    if not seconds:
                        raise SystemExit("eval.py finished no scoring while train.py ran: raise --steps")
                    scoring_s += seconds
                (beside if side else alone).append(run["tokens_per_s"])
                print(f"round {r} {'with eval.py beside' if side else 'alone'}: {run['tokens_per_s']:,.0f} tokens/s",
                      flush=True)  # fmt: skip
    ratio = statistics.median(b / a for a, b in zip(alone, beside))
    record(
        "tasks_beside_training",
        {
            "setup": f"train.py: 3 CPU processes, ZeRO-3, {args.model_config}, 4 x 128 tokens per process, "
            f"{args.steps} steps, {args.rounds} rounds; beside it: eval.py --tasks local_mc (16 questions) on a "
            "checkpoint, back to back",
            "tokens_per_s_alone": [round(x) for x in alone],
            "tokens_per_s_beside": [round(x) for x in beside],
            "eval_py_seconds_per_scoring": round(statistics.median(scoring_s), 1),
            "ratio_beside_vs_alone": ratio,
        },
    )


if __name__ == "__main__":
    main()
