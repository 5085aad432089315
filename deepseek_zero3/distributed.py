"""How this run was launched: the Accelerator and its process group (joined again after a restart), and the one
record of a launch (processes, machines, precision, accumulation, offload, ZeRO stage) that both a live run
(`live_launch`) and a plan on paper (`read_launch`, from an accelerate YAML) read through `launch_record`, so both see
the same values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import torch

from deepseek_zero3 import cli
from deepseek_zero3.cli import UserError


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a run is launched, as its accelerate config says."""

    world_size: int
    nodes: int
    precision: str  # fp32 | fp16 | bf16
    grad_accum_steps: int
    offload_optimizer: str  # none | cpu | nvme
    offload_params: bool
    gpu: bool
    zero_stage: int  # 0: no DeepSpeed (plain DDP, or one process)


def launch_record(
    mixed_precision: str,
    ds_config: dict,
    yaml_deepspeed: dict,
    world_size: int,
    nodes: int,
    gpu: bool,
    deepspeed: bool,
    default_accum: int = 1,
) -> Launch:
    """The one place a launch is read. ds_config: the DeepSpeed JSON (the live plugin's resolved config, or the file
    a YAML names); yaml_deepspeed: the YAML's deepspeed_config keys, which count where the JSON is silent; deepspeed:
    whether DeepSpeed runs at all (else plain DDP or one process)."""
    zero = ds_config.get("zero_optimization", {})
    precision = mixed_precision
    if ds_config.get("fp16", {}).get("enabled") is True:
        precision = "fp16"
    elif ds_config.get("bf16", {}).get("enabled") is True:
        precision = "bf16"
    accum = ds_config.get("gradient_accumulation_steps", yaml_deepspeed.get("gradient_accumulation_steps", "auto"))

    def offloaded(key: str, yaml_key: str) -> str:
        return zero.get(key, {}).get("device") or yaml_deepspeed.get(yaml_key) or "none"

    return Launch(
        world_size=world_size,
        nodes=nodes,
        precision={"no": "fp32"}.get(precision, precision),
        grad_accum_steps=default_accum if accum == "auto" else int(accum),
        offload_optimizer=offloaded("offload_optimizer", "offload_optimizer_device"),
        offload_params=offloaded("offload_param", "offload_param_device") != "none",
        gpu=gpu,
        zero_stage=int(zero.get("stage", yaml_deepspeed.get("zero_stage", 3))) if deepspeed else 0,
    )


def read_launch(path: str) -> Launch:
    """The launch an accelerate YAML (and the DeepSpeed JSON it may name) describes, without launching."""
    import yaml

    y = yaml.safe_load(Path(path).read_text())
    if not isinstance(y, dict) or "distributed_type" not in y:
        raise UserError(f"{path} is not an accelerate config (a YAML with distributed_type): see accelerate_configs/")
    deepspeed = y["distributed_type"] == "DEEPSPEED"
    ds = (y.get("deepspeed_config") or {}) if deepspeed else {}
    js = json.loads(Path(ds["deepspeed_config_file"]).read_text()) if ds.get("deepspeed_config_file") else {}
    stage = js.get("zero_optimization", {}).get("stage", ds.get("zero_stage", 3))
    if deepspeed and not isinstance(stage, int):
        raise UserError(f"{path}: zero_stage {stage!r} must be 0-3 for --plan to count it")
    return launch_record(
        y.get("mixed_precision", "no"),
        js,
        ds,
        int(y.get("num_processes", 1)),
        int(y.get("num_machines", 1)),
        not y.get("use_cpu", False),
        deepspeed,
    )


def live_launch(accelerator) -> Launch:
    """The launch this process is part of."""
    plugin = accelerator.state.deepspeed_plugin
    gpu = torch.cuda.is_available()
    world = accelerator.num_processes
    return launch_record(
        accelerator.mixed_precision,
        plugin.deepspeed_config if plugin else {},
        {},
        world,
        max(1, world // max(1, torch.cuda.device_count())) if gpu else 1,
        gpu,
        plugin is not None,
        default_accum=accelerator.gradient_accumulation_steps,
    )


def join_restarted_process_group() -> None:
    """After a restart by `accelerate launch --max_restarts N` (torchrun's elastic agent), create the process group
    under a key prefix of this attempt, before Accelerate and DeepSpeed would (DeepSpeed adopts a group that exists).

    Why: the configs' rdzv_backend `static` keeps ONE key-value store on the launcher for every attempt, and the
    workers join it with no per-attempt prefix (torch's env:// rendezvous assumes a fresh store per attempt). The
    restarted workers then read the dead attempt's gloo/NCCL addresses and fail ("Connection refused") or hang. An
    upstream fix would give each static-rendezvous attempt a fresh store or an attempt prefix in the workers' store.
    The first attempt is left to Accelerate as before."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    import datetime

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(minutes=30)
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout)
    kwargs = {}
    if torch.cuda.is_available():  # bound to its GPU, as DeepSpeed binds it
        kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(kwargs["device_id"])
    torch.distributed.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        store=torch.distributed.PrefixStore(f"train.py/attempt_{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
        **kwargs,
    )


def start_accelerator(project_dir: str):
    """The Accelerator of this process, refusing a launch whose processes would not synchronise. Its trackers are set
    by run_dir.trackers.start, once a resumed run's own --log_with is known."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    # Launched on CPUs, DeepSpeed needs gloo named explicitly or Accelerate and DeepSpeed disagree on the world size.
    # A plain `python train.py` has no process group to create; LOCAL_RANK is how Accelerate itself tells.
    launched = "LOCAL_RANK" in os.environ
    kwargs = [InitProcessGroupKwargs(backend="gloo")] if launched and not torch.cuda.is_available() else []
    join_restarted_process_group()
    with cli.without_noise():
        accelerator = Accelerator(project_dir=project_dir, kwargs_handlers=kwargs)
    if accelerator.mixed_precision == "fp16" and accelerator.state.deepspeed_plugin is None and not accelerator.scaler:
        raise UserError(
            f"fp16 without DeepSpeed needs a GPU: on {accelerator.device.type} Accelerate would run it as fp32 with "
            f"no loss scaling. Launch with accelerate_configs/zero3_cpu.yaml (DeepSpeed trains fp16 where oneDNN "
            f"has fp16), or use --mixed_precision bf16 or no"
        )
    started = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if started > 1 and accelerator.distributed_type == DistributedType.NO:  # torchrun on CPUs without the variable
        raise UserError(
            f"{started} processes were started but Accelerate runs them as "
            f"{accelerator.distributed_type.value}, with no gradient sync: each would train its own copy. "
            f"On CPUs launch with ACCELERATE_USE_CPU=1 torchrun --nproc_per_node {started} train.py ..., "
            f"or accelerate launch --config_file accelerate_configs/zero3_cpu.yaml train.py ..."
        )
    return accelerator


@contextlib.contextmanager
def without_zero3_init(accelerator):
    """A block in which transformers does not build models under ZeRO-3's zero.Init: for a model built only to be
    looked at, on the meta device, which from_pretrained refuses under ZeRO-3. transformers reads ZeRO-3 from the
    DeepSpeed config Accelerate registers with it (the plugin's dschf, also with zero3_init_flag off): unregistered
    for the block, the same object registered again after it."""
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    plugin = accelerator.state.deepspeed_plugin
    held = getattr(plugin, "dschf", None) if plugin is not None else None
    if held is None:
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(held)
