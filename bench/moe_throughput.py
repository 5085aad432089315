"""The quickstart-size MoE preset against a dense model with the same activated FLOPs per token, under train.py.

    python bench/moe_throughput.py [--moe deepseek-v3-mini] [--dense mini] [--processes 3] [--rounds 2]

Both train through `accelerate launch` with the ZeRO-3 CPU config on --processes processes, the same data, sequence
length and global batch, in alternation --rounds times; steady-state tokens/s skips the first log interval, and the
median of the rounds counts. The dense side is the --dense Llama preset with its intermediate_size set so its
training FLOPs per token (model_math.model_flops_per_token) equal the MoE preset's, which counts only the experts a
token goes to. Target: the MoE at least 0.6 of the dense model's tokens/s.

Where the MoE's time goes: one process, no ZeRO, forward + backward steps of the MoE preset; forward hooks time the
routers, the routed experts and the attention, as shares of the forward, and the forward's share of the step.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import free_port, prepare_docs, record, train_py_rate

from deepseek_zero3.model import models
from deepseek_zero3.planning import model_math
from deepseek_zero3.training_data import token_data


def dense_twin(moe_config, dense_preset: str, seq_len: int, meta: dict, out: Path) -> tuple[Path, float, float]:
    """A config.json of the dense preset whose FLOPs per token equal the MoE's: (path, MoE FLOPs, dense FLOPs)."""
    dense = models.load_model_config(dense_preset, "", seq_len, meta)
    target = model_math.model_flops_per_token(moe_config, seq_len)
    per_unit = 6 * 3 * dense.hidden_size * dense.num_hidden_layers  # FLOPs per token per unit of intermediate_size
    dense.intermediate_size += round((target - model_math.model_flops_per_token(dense, seq_len)) / per_unit)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"model_type": dense.model_type, **dense.to_diff_dict()}, indent=2))
    return out / "config.json", target, model_math.model_flops_per_token(dense, seq_len)


def where_time_goes(moe_config, seq_len: int, batch: int, steps: int = 3) -> dict:
    """Share of one process's forward time by module kind (fp32, no ZeRO), timed by forward hooks, and the share of
    the whole step (forward + backward + nothing else) that the forward takes."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config, dtype=torch.float32)
    ids = torch.randint(0, moe_config.vocab_size, (batch, seq_len + 1))
    kinds = {"DeepseekV3TopkRouter": "routers", "DeepseekV3Experts": "routed experts",
             "DeepseekV3Attention": "attention"}  # fmt: skip
    spent = {kind: 0.0 for kind in kinds.values()}
    started = {}
    for module in model.modules():
        kind = kinds.get(type(module).__name__)
        if kind:
            module.register_forward_pre_hook(lambda m, a, k=kind: started.__setitem__(k, time.perf_counter()))
            module.register_forward_hook(
                lambda m, a, o, k=kind: spent.__setitem__(k, spent[k] + time.perf_counter() - started[k])
            )
    forward_s = step_s = 0.0
    for i in range(steps + 1):  # the first is a warm-up
        for kind in spent:
            spent[kind] = 0.0 if i == 1 else spent[kind]
        t0 = time.perf_counter()
        logits = model(input_ids=ids[:, :-1]).logits
        t1 = time.perf_counter()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        if i:
            forward_s, step_s = forward_s + t1 - t0, step_s + time.perf_counter() - t0
    share = {f"forward_share_{kind.replace(' ', '_')}": t / forward_s for kind, t in spent.items()}
    return {**share, "forward_share_of_step": forward_s / step_s}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moe", default="deepseek-v3-mini")
    ap.add_argument("--dense", default="mini")
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rates = {"moe": [], "dense": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prepare_docs(str(tmp), vocab=4096)
        meta = token_data.read_meta(data)
        moe_config = models.load_model_config(args.moe, "", args.seq_len, meta)
        dense_path, moe_flops, dense_flops = dense_twin(moe_config, args.dense, args.seq_len, meta, tmp / "dense")
        presets = {"moe": args.moe, "dense": str(dense_path)}
        for r in range(args.rounds):
            for name, model_config in presets.items():
                port = str(free_port())
                launcher = ["accelerate", "launch", "--config_file", "accelerate_configs/zero3_cpu.yaml",
                            "--num_processes", str(args.processes), "--main_process_port", port]  # fmt: skip
                result = train_py_rate(launcher, data, tmp / f"{name}{r}", model_config, args.seq_len, args.batch,
                                       args.steps, processes=args.processes)  # fmt: skip
                rates[name].append(result["tokens_per_s"])
        profile_share = where_time_goes(moe_config, args.seq_len, args.batch)
        dense_width = json.loads(dense_path.read_text())["intermediate_size"]
    counts = model_math.param_counts(moe_config)
    moe, dense = statistics.median(rates["moe"]), statistics.median(rates["dense"])
    record("moe_throughput", {
        "moe_preset": args.moe, "moe_parameters": counts["total"], "moe_activated_parameters": counts["activated"],
        "dense_preset": f"{args.dense}, intermediate_size {dense_width}",
        "moe_flops_per_token": moe_flops, "dense_flops_per_token": dense_flops, "processes": args.processes,
        "tokens_per_step": args.processes * args.batch * args.seq_len, "moe_tokens_per_s_rounds": rates["moe"],
        "dense_tokens_per_s_rounds": rates["dense"], "ratio_moe_vs_dense": moe / dense, "target": 0.6,
        **profile_share,
    })  # fmt: skip


if __name__ == "__main__":
    main()
