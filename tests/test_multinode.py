"""Two `accelerate launch` "machines" on this one host over loopback (CPU, gloo, ZeRO-3, 1 process each): same losses
as one launch of the same world size and global batch, and both machines resume with --resume auto."""

import subprocess

from conftest import ACCELERATE, CPU_CONFIG, REPO, TINY, free_port, launch, run, train_records
from test_train import assert_same_weights


def launch_two_machines(*train_args):
    port = str(free_port())
    base = [ACCELERATE, "launch", "--config_file", CPU_CONFIG, "--num_machines", "2", "--num_processes", "2",
            "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--deepspeed_multinode_launcher", "standard"]
    args = ["train.py", *map(str, train_args)]
    second = subprocess.Popen(base + ["--machine_rank", "1"] + args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = run(base + ["--machine_rank", "0"] + args)
        out, _ = second.communicate(timeout=300)
    finally:
        second.kill()
    assert second.returncode == 0, out[-4000:]
    return first


def test_two_machines_match_one_launch_and_resume(docs_data, tmp_path):
    common = [*TINY, "--micro_batch_size", "2", "--data_dir", docs_data, "--lr_decay_steps", "6"]
    single = tmp_path / "single"
    launch(2, *common, "--max_steps", "6", "--output_dir", single)
    multi = tmp_path / "multi"
    launch_two_machines(*common, "--max_steps", "3", "--output_dir", multi)
    assert (multi / "checkpoints" / "step_3" / "trainer_state.json").is_file()
    proc = launch_two_machines(*common, "--max_steps", "6", "--output_dir", multi, "--resume", "auto")
    assert "resumed from" in proc.stdout
    a, b = train_records(single), train_records(multi)
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(a[step]["loss"] - b[step]["loss"]) / a[step]["loss"] < 1e-6, (step, a[step]["loss"], b[step]["loss"])
    assert_same_weights(single, multi)
