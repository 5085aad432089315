"""Validation under ZeRO-3 costs only its own time (issue #22). DeepSpeed memoises which parameters to release after
each sub-module's forward; a forward-only pass (validation) before training used to leave "release everything" in
that memo, so every later step released each parameter after its forward and gathered it again in backward. The
proof counts parameter releases per training step (each one is an all-gather when the parameter is next needed), a
count that does not depend on the machine's speed: with a validation at step 0 and another mid-run, a step releases
exactly as often as in a run without validation. Without the fix: 53 per step against 37 (tiny preset).
"""

import json

import pytest

from conftest import REPO, launch_cmd, run

SCRIPT = r"""
import json, sys
sys.path.insert(0, {repo!r})
import torch, torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from transformers import AutoConfig, AutoModelForCausalLM
from deepseek_zero3.cli import exit_process
from deepseek_zero3.model import lmloss
from deepseek_zero3.training_data import token_data

from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

releases = [0]  # parameters released after use, to be gathered again when next needed
_release = Coordinator._PartitionedParameterCoordinator__release_param
def counted(self, *a, **k):
    releases[0] += 1
    return _release(self, *a, **k)
Coordinator._PartitionedParameterCoordinator__release_param = counted

acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
cfg = json.load(open({repo!r} + "/model_configs/tiny.json"))
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
model, opt = acc.prepare(model, opt)
tokens = token_data.load_split({data!r}, "train")[:4096]
x = torch.from_numpy(token_data.window(tokens, 0, 32)[None].repeat(2, 0))
validate = sys.argv[1] == "validate"
per_step = []
for step in range(8):
    if validate and step in (0, 4):
        lmloss.validation_loss(model, acc, tokens[:257], 32, 2)
    before = releases[0]
    loss = F.cross_entropy(model(input_ids=x[:, :-1], use_cache=False).logits.flatten(0, 1), x[:, 1:].flatten())
    acc.backward(loss); opt.step(); opt.zero_grad()
    per_step.append(releases[0] - before)
acc.print("RELEASES " + json.dumps(per_step))
exit_process(0)  # past the gloo teardown abort (see cli.exit_process)
"""


def releases_per_step(tmp_path, docs_data, mode: str) -> list[int]:
    script = tmp_path / "count_releases.py"
    script.write_text(SCRIPT.format(repo=str(REPO), data=str(docs_data)))
    proc = run(launch_cmd(1, mode, script=str(script)))
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RELEASES "))
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.launch
def test_validation_leaves_later_steps_releasing_as_often_as_without(docs_data, tmp_path):
    plain = releases_per_step(tmp_path, docs_data, "plain")
    validated = releases_per_step(tmp_path, docs_data, "validate")
    # Steps 0 and 1 record the trace again after the step-0 validation (no prefetch yet); from then on, the same:
    # the mid-run validation leaves the trace training recorded.
    assert validated[2:] == plain[2:], (plain, validated)
