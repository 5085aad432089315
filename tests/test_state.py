"""train.py's checkpoint_state(): the one registry of what a checkpoint holds beside model and optimizer
(run_dir/state.py). The EMA's exact resume on 3, 2 and 1 processes is proven by the runs that share conftest's
ref_run (test_train.py::test_resume_is_exact, test_reshard.py); here, the registry's own rules with real files and, for
the check that needs several processes, a real 2-process launch."""

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, free_port, run

from deepseek_zero3.cli import UserError
from deepseek_zero3.model import weights
from deepseek_zero3.run_dir import state

ALONE = SimpleNamespace(
    process_index=0, num_processes=1, print=print
)  # what state.py reads of one process's Accelerator


class Counter:
    """A piece a forker might add: a number every process holds the same."""

    def __init__(self, value=0):
        self.value, self.restarted = value, False

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, s):
        self.value = s["value"]

    def restart(self):
        self.restarted = True


class Shares(Counter):
    """One share per process, with no way to cut it again for another number of processes."""

    sharded = True


def test_a_replicated_piece_round_trips_and_a_missing_one_restarts(tmp_path, capsys):
    state.save(tmp_path, {"counter": Counter(7), "absent": None}, ALONE, finalises_checkpoints=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state-counter.pt"]
    loaded, new = Counter(), Counter()
    state.load(tmp_path, {"counter": loaded, "new": new, "absent": None}, ALONE)
    assert loaded.value == 7 and not loaded.restarted
    assert (
        new.restarted and "holds no state 'new' (saved before it existed, or by a run without it): it starts fresh"
        in capsys.readouterr().out
    )


def test_a_sharded_piece_resumes_on_its_own_process_count_or_is_refused_naming_it(tmp_path):
    for rank in range(2):  # as two processes wrote it
        torch.save({"world_size": 2, "state": {"value": 10 + rank}}, state.shard_file(tmp_path, "shares", rank))
    mine = Shares()
    two = SimpleNamespace(process_index=1, num_processes=2, print=print)
    state.load(tmp_path, {"shares": mine}, two)
    assert mine.value == 11
    with pytest.raises(UserError, match=r"its state 'shares' is one share per process of 2 and its object has no "
                                        r"reshard\(\); resume on 2 processes"):  # fmt: skip
        state.load(tmp_path, {"shares": Shares()}, ALONE)


def test_a_share_copied_over_another_process_s_is_refused_and_a_dropped_piece_is_said(tmp_path, capsys):
    """Each process's file names its process: rank 0's share copied over rank 1's (a hand-assembled checkpoint of
    node-local disks) is refused, not resumed as rank 1's average (seen resuming silently, 0.1 off, before the check).
    A piece the checkpoint holds that this run does not keep (--ema_decay 0 on resume) is said."""
    two = [SimpleNamespace(process_index=r, num_processes=2, print=print) for r in range(2)]
    for rank in range(2):
        share = Shares(10 + rank)
        share.sharded = True
        state.save(tmp_path, {"shares": share}, two[rank], finalises_checkpoints=rank == 0)
    state.load(tmp_path, {"shares": Shares()}, two[1])
    state.shard_file(tmp_path, "shares", 1).write_bytes(state.shard_file(tmp_path, "shares", 0).read_bytes())
    with pytest.raises(UserError, match=r"rank1.pt holds process 0's share of 'shares', not process 1's"):
        state.load(tmp_path, {"shares": Shares()}, two[1])
    state.load(tmp_path, {"shares": None}, two[0])
    assert "holds state 'shares', which this run does not keep" in capsys.readouterr().out


def test_a_damaged_piece_is_one_line(tmp_path):
    state.replicated_file(tmp_path, "counter").write_bytes(b"not a torch file")
    with pytest.raises(UserError, match=r"cannot load checkpoint state 'counter' from .*: UnpicklingError"):
        state.load(tmp_path, {"counter": Counter()}, ALONE)


def test_zero3_partitions_are_cut_again_for_any_process_count():
    """repartition follows ZeRO-3's layout (ceil(numel / processes) per process) without its padding, as local_weights
    gives a partition (the padding holds undefined values): 10 elements written by 3 processes (4, 4, 2) read back by
    1, 2 and 4 (3, 3, 3, 1)."""
    whole = torch.arange(10.0)
    written = [weights.repartition([whole], 10, r, 3) for r in range(3)]
    assert [len(s) for s in written] == [4, 4, 2] and written[2].tolist() == [8, 9]
    for world in (1, 2, 4):
        parts = [weights.repartition(written, 10, r, world) for r in range(world)]
        size = -(-10 // world)
        assert torch.equal(torch.cat(parts), whole) and [len(p) for p in parts] == [
            min(size, 10 - r * size) for r in range(world)
        ]


SCRIPT = """
import sys; sys.path.insert(0, {repo!r})
from pathlib import Path
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from deepseek_zero3.cli import UserError, exit_process
from deepseek_zero3.run_dir import state

class Seen:
    def __init__(self, value): self.value = value
    def state_dict(self): return {{"value": self.value}}
    def load_state_dict(self, s): self.value = s["value"]

accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
rank = accelerator.process_index
out = Path({out!r})
state.save(out, {{"same": Seen(1)}}, accelerator, finalises_checkpoints=rank == 0)
try:
    state.save(out, {{"data_position": Seen(rank)}}, accelerator, finalises_checkpoints=rank == 0)
except UserError as e:
    print(f"rank {{rank}} of {{accelerator.num_processes}}: refused: {{e}}", flush=True)
exit_process(0)  # as train.py ends: a gloo thread can abort Python's teardown (-6; seen here once in CI's suite)
"""


@pytest.mark.launch
def test_a_piece_the_processes_disagree_on_is_refused_not_saved_as_process_0s(tmp_path):
    """Accelerate's own registry (register_for_checkpointing) saves process 0's copy and resumes every process with
    it, silently; a piece here that differs between processes is refused in one line naming it. 2 real processes."""
    script = tmp_path / "save.py"
    script.write_text(SCRIPT.format(repo=str(REPO), out=str(tmp_path)))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    proc = run([torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)],
               env={"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}, timeout=300)  # fmt: skip
    # The two processes share one stdout pipe: their lines can arrive joined, so each refusal is found, not each line.
    said = "refused: checkpoint state 'data_position' differs between processes"
    refused = sorted(re.findall(rf"rank (\d) of 2: {re.escape(said)}", proc.stdout))
    assert refused == ["0", "1"], proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["save.py", "state-same.pt"]


@pytest.mark.parametrize("decay", [1.5, 1.0, -0.1, float("nan"), float("inf")])
def test_an_ema_decay_outside_0_1_is_refused(decay):
    """1 never moves the average, above 1 or below 0 it grows without bound (seen exporting 'ema = 1.5 x ema + -0.5 x
    weights' before the check)."""
    import train

    with pytest.raises(UserError, match=rf"--ema_decay {decay} must be within \[0, 1\)"):
        train.check_flags(train.Config(ema_decay=decay))
    train.check_flags(train.Config(ema_decay=0.999))
