"""make test-fast's guard (conftest.refuse_launch_in_fast_tier): under TEST_TIER=fast, a multi-process launch from a
test not marked `launch` fails that test, however the command is spelled (every child process goes through the guard:
conftest wraps subprocess.Popen in that tier). Seen failing with the guard reading only the first word."""

import pytest
from conftest import refuse_launch_in_fast_tier

LAUNCHES = [
    ["accelerate", "launch", "--num_processes", "3", "train.py"],
    ["/venv/bin/accelerate", "launch", "train.py"],
    ["timeout", "300", "accelerate", "launch", "train.py"],
    ["bash", "-c", "accelerate launch --num_processes 2 train.py"],
    "accelerate launch train.py",
    ["python", "-m", "accelerate.commands.launch", "train.py"],
    ["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py"],
    ["torchrun", "--nproc_per_node", "2", "train.py"],
]
NOT_LAUNCHES = [["python", "train.py", "--plan"], ["accelerate", "env"], ["python", "eval.py", "--model", "accelerate"],
                ["python", "-c", "import sys  # it's one process"]]  # a script no shell could split


@pytest.mark.parametrize("args", LAUNCHES)
def test_a_launch_in_the_fast_tier_fails_its_test(args, monkeypatch):
    monkeypatch.setenv("TEST_TIER", "fast")
    with pytest.raises(pytest.fail.Exception, match="mark this test @pytest.mark.launch"):
        refuse_launch_in_fast_tier(args)
    monkeypatch.delenv("TEST_TIER")
    refuse_launch_in_fast_tier(args)  # make test runs it


@pytest.mark.parametrize("args", NOT_LAUNCHES)
def test_one_process_is_not_a_launch(args, monkeypatch):
    monkeypatch.setenv("TEST_TIER", "fast")
    refuse_launch_in_fast_tier(args)
