"""Issue #43: where a step's time goes. The profile's split into the plan's components agrees with the same parts
timed by hand, and a real ZeRO-2 run with --profile_steps writes it per process, with the plan it made at start, for
`train.py --plan --from_run OUT` to print beside each other."""

import json
import sys

import pytest
from conftest import TINY, free_port, launch, run

from deepseek_zero3.planning import breakdown

# One process, a gloo group of one: compute (matmuls), a copy, torch's AdamW step and an all-reduce, each timed by
# perf_counter as the profiler records the same steps (the first warms up).
TIMED_BY_HAND = r"""
import json, os, time, torch, torch.distributed as dist
from deepseek_zero3.planning import breakdown
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
a, big, buf = torch.randn(384, 384), torch.randn(8 << 20), torch.randn(4 << 20)
into = torch.empty_like(big)
w = torch.nn.Parameter(torch.randn(1024, 1024)); w.grad = torch.randn_like(w); opt = torch.optim.AdamW([w])
steps, timed, result = 3, {}, {}
parts = {"compute": lambda: [a @ a for _ in range(40)], "copies": lambda: into.copy_(big), "optimizer": opt.step,
         "all_reduce": lambda: dist.all_reduce(buf)}
def ready(prof):
    result["split"] = breakdown.split_events(prof.events(), steps)[0]
sched = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
cpu = [torch.profiler.ProfilerActivity.CPU]
with torch.profiler.profile(activities=cpu, schedule=sched, on_trace_ready=ready) as p:
    for i in range(steps + 1):
        for key, fn in parts.items():
            t0 = time.perf_counter(); fn(); timed[key] = timed.get(key, 0.0) + (i > 0) * (time.perf_counter() - t0)
        p.step()
print(json.dumps({"timed": {k: v / steps for k, v in timed.items()}, "split": result["split"]}))
"""


def test_the_profile_splits_a_step_as_timing_its_parts_does(tmp_path):
    proc = run([sys.executable, "-c", TIMED_BY_HAND], env={"PORT": str(free_port())})
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    timed, split = got["timed"], got["split"]
    for key in ("compute", "copies", "optimizer"):  # each on the training thread
        assert split[key] == pytest.approx(timed[key], rel=0.25), (key, timed, split)
    # the all-reduce: its span from the call to the end of gloo's worker; a one-process gloo all-reduce is a copy
    assert 0 < split["all_reduce"] <= 1.5 * timed["all_reduce"] + 1e-3, (timed, split)
    assert abs(split["unattributed"]) < 0.25 * sum(timed.values()), (timed, split)


def test_a_zero2_run_profiles_its_steps_and_the_plan_reads_them(docs_data, tmp_path):
    """Two ZeRO-2 processes, 6 steps logged every 2, --profile_steps 2 (steps 2-3); then a second, one-process run that
    ends inside its profiled steps (3 steps, --profile_steps 5) writes the two it completed and exits 0 (a profiler
    left running crashed the interpreter's teardown: exit 139)."""
    out = tmp_path / "z2"
    args = [*TINY, "--max_steps", "6", "--log_every", "2", "--micro_batch_size", "2", "--profile_steps", "2"]
    launch(2, *args, "--data_dir", docs_data, "--output_dir", out, config="accelerate_configs/zero2_cpu.yaml",
           accum=2)  # fmt: skip
    plan = json.loads((out / "plan.json").read_text())
    assert plan["strategy"] == "ZeRO-2" and plan["launch"]["world_size"] == 2, plan
    assert plan["planned_s"]["all_reduce"] > 0 and plan["planned_s"]["reduce_scatter"] == 0
    for rank in (0, 1):
        split = json.loads((out / "profile" / f"rank{rank}.json").read_text())["seconds_per_step"]
        assert set(split) == set(breakdown.COMPONENTS)
        assert split["compute"] > 0 and split["copies"] > 0 and split["optimizer"] > 0, split
        assert split["all_reduce"] > 0 and split["all_gather"] > 0, split  # ZeRO-2's gradients, its parameters
    shown = run([sys.executable, "train.py", "--plan", "--from_run", out]).stdout
    assert "measured/planned" in shown and "  all_reduce" in shown and "step (not profiled)" in shown, shown
    refused = run([sys.executable, "train.py", "--plan", "--from_run", tmp_path], check=False)
    assert refused.returncode == 2 and "plan.json is missing" in refused.stderr, refused.stderr
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text()[:-20])  # a torn last line: passed over
    assert "measured/planned" in run([sys.executable, "train.py", "--plan", "--from_run", out]).stdout
    (out / "profile" / "rank1.json").write_text('{"steps": 2, "first_step": 2, "seconds_per_step": {"compute": "x"}}')
    refused = run([sys.executable, "train.py", "--plan", "--from_run", out], check=False)
    assert refused.returncode == 2 and "rank1.json is not as train.py writes it" in refused.stderr, refused.stderr
    short = tmp_path / "short"
    run([sys.executable, "train.py", *TINY, "--max_steps", "3", "--micro_batch_size", "2", "--profile_steps", "5",
         "--no_eval_at_start", "--data_dir", docs_data, "--output_dir", short])  # fmt: skip
    profile = json.loads((short / "profile" / "rank0.json").read_text())
    assert (profile["steps"], profile["first_step"]) == (2, 2), profile
