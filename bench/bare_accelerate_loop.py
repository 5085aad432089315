"""A bare Accelerate + DeepSpeed training loop, the yardstick for train.py: what a user would write instead.

    accelerate launch --config_file accelerate_configs/zero3_cpu.yaml bench/bare_accelerate_loop.py \
        --data_dir data/python-docs --model_config small --seq_len 256 --micro_batch_size 4 --steps 30

The same model preset and token windows as train.py, AdamW, a DataLoader through `accelerator.prepare`, then
forward, `accelerator.backward`, `optimizer.step` and nothing else: no logging, validation, checkpoints or signal
handling (--eval_first adds two no-grad forwards before training, as train.py's step-0 validation does). It runs
on any accelerate config, the DeepSpeed ones included. Prints one JSON line: the processes and
accumulation it ran with and its steady-state tokens/s (wall time of the steps after the first third).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from transformers import AutoConfig, AutoModelForCausalLM


class Windows(torch.utils.data.Dataset):
    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        return torch.from_numpy(np.asarray(self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1], dtype=np.int64))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--model_config", default="small")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--micro_batch_size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--eval_first", action="store_true", help="two no-grad forwards before training, as a validation at step 0"
    )
    args = ap.parse_args()
    cpu = not torch.cuda.is_available()
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if cpu else [])
    meta = json.loads((Path(args.data_dir) / "meta.json").read_text())
    tokens = np.memmap(Path(args.data_dir) / "train.bin", dtype=meta["dtype"], mode="r")
    preset = json.loads(
        (Path(__file__).resolve().parents[1] / "model_configs" / f"{args.model_config}.json").read_text()
    )
    config = AutoConfig.for_model(
        preset.pop("model_type"), **{**preset, "vocab_size": -(-meta["vocab_size"] // 64) * 64}
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    loader = torch.utils.data.DataLoader(
        Windows(tokens, args.seq_len),
        batch_size=args.micro_batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if args.eval_first:
        model.eval()
        with torch.no_grad():
            for batch, _ in zip(loader, range(2)):
                model(input_ids=batch[:, :-1], use_cache=False)
        model.train()
    micro_steps = args.steps * accelerator.gradient_accumulation_steps
    times, batches = [], iter(loader)
    for _ in range(micro_steps):
        batch = next(batches)
        with accelerator.accumulate(model):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        times.append(time.perf_counter())
    steady = times[len(times) // 3 :]
    tokens_per_micro_step = args.micro_batch_size * args.seq_len * accelerator.num_processes
    accelerator.print(
        json.dumps(
            {
                "processes": accelerator.num_processes,
                "distributed_type": accelerator.distributed_type.value,
                "grad_accum_steps": accelerator.gradient_accumulation_steps,
                "final_loss": float(loss),
                "tokens_per_s": tokens_per_micro_step * (len(steady) - 1) / (steady[-1] - steady[0]),
            }
        )
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    # the one addition to a bare loop: leave without the gloo teardown crash
    from deepseek_zero3.cli import exit_process

    exit_process(0)
