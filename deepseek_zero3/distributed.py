"""How this run was launched: the Accelerator and its process group (joined again after a restart), and the one
record of a launch (processes, machines, precision, accumulation, offload, ZeRO stage) that both a live run
(`live_launch`) and a plan on paper (`read_launch`, from an accelerate YAML) read through `launch_record`, so both see
the same values; before any of it, the build locks that killed launches left in torch's extension directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
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
    grad_accum_dtype_set: str = ""  # the DeepSpeed config's data_types.grad_accum_dtype, where it names one

    @property
    def grad_accum_dtype(self) -> str:
        """What gradients are summed in over the micro-steps of a step. Under DeepSpeed: the config's
        data_types.grad_accum_dtype where it names one; else fp32 for bf16 under ZeRO-2/3, which train.py sets
        (DeepSpeed's default is the model's dtype: bf16 rounds the sum to 8 bits of mantissa at every micro-step);
        else the model's dtype (ZeRO-1 takes another optimizer wrapper for bf16 with fp32 sums, BF16_Optimizer, which
        refuses Muon's 3-D expert tensors, and DeepSpeed without ZeRO refuses the mix). Without DeepSpeed: the fp32
        parameters' own gradients."""
        if not self.zero_stage:
            return "fp32"
        if self.grad_accum_dtype_set:
            return self.grad_accum_dtype_set
        return "fp32" if self.precision == "bf16" and self.zero_stage in (2, 3) else self.precision


# DeepSpeed's names of a dtype (its DtypeEnum), as a launch's precision names them.
DTYPE_NAMES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


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

    accum_dtype = str((ds_config.get("data_types") or {}).get("grad_accum_dtype") or "").removeprefix("torch.")

    return Launch(
        world_size=world_size,
        nodes=nodes,
        precision={"no": "fp32"}.get(precision, precision),
        grad_accum_steps=default_accum if accum == "auto" else int(accum),
        offload_optimizer=offloaded("offload_optimizer", "offload_optimizer_device"),
        offload_params=offloaded("offload_param", "offload_param_device") != "none",
        gpu=gpu,
        zero_stage=int(zero.get("stage", yaml_deepspeed.get("zero_stage", 3))) if deepspeed else 0,
        grad_accum_dtype_set=DTYPE_NAMES.get(accum_dtype, accum_dtype),
    )


def describe_engine(engine, grad_accum_steps: int) -> str:
    """What a prepared DeepSpeed engine runs, read from it, for a startup line: its ZeRO stage, the optimizer inside
    its ZeRO wrapper (with Muon, the class of its AdamW half: DeepSpeed's inline update where it has none), and the
    dtype it sums the micro-steps' gradients in (its ZeRO optimizer's buffers', else its config's)."""
    zero = engine.optimizer
    base = getattr(zero, "optimizer", zero)
    name = type(base).__name__
    if hasattr(base, "aux_optimizer"):
        name += f" (AdamW half: {type(base.aux_optimizer).__name__ if base.aux_optimizer else 'inline update'})"
    dtype = str(getattr(zero, "gradient_accumulation_dtype", None) or engine.get_data_types()[1])
    dtype = DTYPE_NAMES.get(dtype.removeprefix("torch."), dtype.removeprefix("torch."))
    return (f"DeepSpeed: ZeRO-{engine.zero_optimization_stage()}, {name}; gradients summed over {grad_accum_steps} "
            f"micro-step(s) per step in {dtype}")


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


def no_gpu_note(device: torch.device, asked: str) -> str:
    """Why a process that CUDA_VISIBLE_DEVICES meant for a GPU has none ('' when it has one, was given --device by
    name (`asked`), or nothing was set). CUDA numbers the GPUs a process is shown from 0, so an index the machine does
    not have (3 on a machine of 3 GPUs: 0, 1, 2), or an empty value, shows it none, and the process runs on the CPU."""
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    if shown is None or asked or device.type != "cpu" or torch.cuda.device_count():
        return ""
    if torch.version.cuda is None:
        return f"note: CUDA_VISIBLE_DEVICES={shown!r} is set, but this torch ({torch.__version__}) has no CUDA: the CPU"
    return (
        f"warning: CUDA_VISIBLE_DEVICES={shown!r} leaves this process no GPU (CUDA numbers the GPUs it is shown from "
        f"0: an index the machine does not have, such as 3 on a machine of 3 GPUs, or an empty value shows none), so "
        f"it runs on the CPU, many times slower. To use a GPU set CUDA_VISIBLE_DEVICES to an index `nvidia-smi -L` "
        f"lists; to use the CPU on purpose pass --device cpu"
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


# DeepSpeed JIT-builds its ops with torch.utils.cpp_extension (on CPUs: deepspeed_shm_comm as the process group
# starts, cpu_adam for an offloaded optimizer), each under a lock file in its build directory that torch's FileBaton
# creates and removes when done; a launch killed meanwhile (Ctrl-C, a scheduler's limit, the OOM killer) leaves it, and
# every later build of that op on the machine polls for it to vanish, forever, printing nothing.
# A build writes into its directory at least every minute or so (deepspeed_shm_comm's here: build.ninja, 45 s later
# its objects, then the library, 46 s in all); a lock whose directory went this long without a write is no build's.
BUILD_LOCK_STALE_S = 120.0


def extension_build_locks() -> list[Path]:
    """The lock files in the build directories of torch's JIT extensions, where torch.utils.cpp_extension puts them:
    $TORCH_EXTENSIONS_DIR/NAME/lock, else <torch's default root>/py<version>_<accelerator>/NAME/lock."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        if torch.version.hip is not None:
            device = f"rocm{torch.version.hip.replace('.', '')}"
        else:
            device = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu"
        root = os.path.join(get_default_build_root(), f"{version}_{device}")
    try:
        return sorted(p for p in Path(root).glob("*/lock") if p.is_file())
    except OSError:
        return []


def build_running_here(build_dir: Path) -> bool:
    """Whether a process of this machine works in build_dir (ninja and the compiler run there). False where /proc
    cannot tell (not Linux): the lock's age and the directory's activity decide alone."""
    target = str(build_dir.resolve())
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            where = os.readlink(cwd)
        except OSError:  # gone, or another user's
            continue
        if where == target or where.startswith(target + os.sep):
            return True
    return False


def last_activity_s(lock: Path) -> float:
    """Seconds since anything in the lock's build directory was written (the lock's creation included)."""
    try:
        latest = max(p.stat().st_mtime for p in lock.parent.iterdir() if p.is_file())
    except (OSError, ValueError):
        return 0.0
    return time.time() - latest


def remove_stale_lock(lock: Path, seen: os.stat_result) -> bool:
    """Remove `lock` if it is still the file `seen` (another process of this launch may have removed it and a build
    taken a new one meanwhile: that one is put back). Returns whether this call removed it."""
    grave = lock.with_name(f"{lock.name}.stale-{os.getpid()}")
    try:
        os.rename(lock, grave)
    except FileNotFoundError:
        return False
    now = os.stat(grave)
    if (now.st_ino, now.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
        try:
            os.link(grave, lock)
        except FileExistsError:
            pass
        os.unlink(grave)
        return False
    os.unlink(grave)
    return True


def clear_stale_build_locks(stale_s: float = BUILD_LOCK_STALE_S, poll_s: float = 2.0) -> None:
    """Before DeepSpeed builds anything: a build lock that no build holds is removed, with a line saying so. A lock
    with a build of its op running on this machine is left to torch (the build ends); one without, in a directory
    written within stale_s (a build on another machine sharing it, or a kill a moment ago), is waited for, said once,
    until it goes or stale_s pass without a write; then it is removed. Every process of a launch may do this at once."""
    for lock in extension_build_locks():
        said, start = False, time.monotonic()
        while True:
            try:
                seen = os.stat(lock)
            except FileNotFoundError:
                break
            if build_running_here(lock.parent):
                break
            idle_s = last_activity_s(lock)  # the lock's own creation counts
            if idle_s >= stale_s:
                if remove_stale_lock(lock, seen):
                    print(f"removed {lock}: a build lock of torch's that no build holds ({idle_s:.0f} s without a "
                          f"write in its directory, no build of {lock.parent.name} running here), left by a launch "
                          "killed while it built; the next build takes a lock of its own", flush=True)  # fmt: skip
                break
            if not said and time.monotonic() - start > 5 * poll_s:  # not a sibling process's build about to start
                said = True
                print(f"waiting for {lock}, torch's build lock of {lock.parent.name}: no build of it runs on this "
                      f"machine, so it is a killed build's or another machine's; it is removed after {stale_s:.0f} s "
                      f"without a write in its directory", flush=True)  # fmt: skip
            time.sleep(poll_s)


def start_accelerator(project_dir: str):
    """The Accelerator of this process, refusing a launch whose processes would not synchronise. Its trackers are set
    by run_dir.trackers.start, once a resumed run's own --log_with is known."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    # Launched on CPUs, DeepSpeed needs gloo named explicitly or Accelerate and DeepSpeed disagree on the world size.
    # A plain `python train.py` has no process group to create; LOCAL_RANK is how Accelerate itself tells.
    launched = "LOCAL_RANK" in os.environ
    kwargs = [InitProcessGroupKwargs(backend="gloo")] if launched and not torch.cuda.is_available() else []
    clear_stale_build_locks()  # DeepSpeed builds its communication op as the process group starts
    join_restarted_process_group()
    with cli.without_noise():
        accelerator = Accelerator(project_dir=project_dir, kwargs_handlers=kwargs)
    if accelerator.mixed_precision == "fp16" and accelerator.state.deepspeed_plugin is None and not accelerator.scaler:
        cpu_fp16_autocast(accelerator)
    started = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if started > 1 and accelerator.distributed_type == DistributedType.NO:  # torchrun on CPUs without the variable
        raise UserError(
            f"{started} processes were started but Accelerate runs them as "
            f"{accelerator.distributed_type.value}, with no gradient sync: each would train its own copy. "
            f"On CPUs launch with ACCELERATE_USE_CPU=1 torchrun --nproc_per_node {started} train.py ..., "
            f"or accelerate launch --config_file accelerate_configs/zero3_cpu.yaml train.py ..."
        )
    return accelerator


def cpu_fp16_autocast(accelerator) -> None:
    """fp16 without DeepSpeed on CPUs: Accelerate 1.15 makes neither autocast nor a GradScaler there (its fp16 is for
    accelerators), so the run would train in fp32 with no loss scaling while calling itself fp16. Where oneDNN has
    fp16 (Xeons with AMX-FP16 or AVX512-FP16) this gives the Accelerator what it makes on a GPU: fp16 autocast around
    the prepared model's forward and torch's GradScaler on the CPU, which its backward, unscale and optimizer step
    then use as they use the CUDA one. So the DDP fp16 path of ddp_3gpu.yaml (loss scaling, skipped steps) runs, and
    is tested, on CPU processes. Elsewhere: refused, before anything is written."""
    if accelerator.device.type != "cpu" or not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        raise UserError(
            f"fp16 without DeepSpeed on {accelerator.device.type}: Accelerate would run it as fp32 with no loss "
            f"scaling, and this CPU has no fp16 in oneDNN (python -c \"import torch; print(torch.ops.mkldnn."
            f"_is_mkldnn_fp16_supported())\" prints False); use --mixed_precision bf16 or no, or a GPU"
        )
    kwargs = accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler is not None else {}
    accelerator.native_amp = True  # prepare() wraps the model's forward in torch.autocast("cpu", float16)
    accelerator.scaler = torch.amp.GradScaler("cpu", **kwargs)


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
