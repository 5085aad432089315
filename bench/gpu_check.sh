#!/usr/bin/env bash
# The GPU check, prepared to run in one go (under 10 minutes) on one CUDA GPU, e.g. a lent H200:
#   bash bench/gpu_check.sh            (from the repository root, in an environment with requirements.txt + CUDA torch)
# 1. fp16 ZeRO-3 with dynamic loss scaling really running (loss scale and skipped steps logged),
# 2. the same in bf16,
# 3. tokens/s and MFU of the deepseek-1.3b preset at sequence length 2048,
# 4. peak GPU memory against the planner's prediction (train.py prints its plan at start),
# 5. the MoE preset deepseek-v3-mini in bf16 (routing, bias balancing and MaxVio on a GPU).
# Everything goes to ${OUT:-bench/results/gpu}; the summary lines are printed at the end.
#   bash bench/gpu_check.sh strategies   instead: each strategy one GPU can run (every config at --num_processes 1:
#                                        ZeRO-2, ZeRO-3, optimizer offload, optimizer + parameter offload), measured
#                                        tokens/s and peak memory beside the plan line each run printed (~6 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python prepare_data.py --dataset python-docs --tokenizer bpe:32000 --output_dir "$OUT/data" --validation_fraction 0.05
if [ "${1:-}" = strategies ]; then
    for config in zero2_3gpu zero3_3gpu zero3_offload_opt_3gpu zero3_offload_3gpu; do
        rm -rf "$OUT/strategy_$config"
        timeout 90 accelerate launch --config_file "accelerate_configs/$config.yaml" --num_processes 1 \
            --gradient_accumulation_steps 1 train.py --data_dir "$OUT/data" --model_config deepseek-1.3b --seq_len 2048 \
            --micro_batch_size 4 --gradient_checkpointing --max_steps 12 --log_every 4 --eval_every 0 --no_eval_at_start \
            --save_every 0 --output_dir "$OUT/strategy_$config" > "$OUT/strategy_$config.log" 2>&1 || true
        planned=$(grep -oE "= [0-9,]+ tokens/s" "$OUT/strategy_$config.log" | head -1)
        measured=$(grep -E "^step 12/" "$OUT/strategy_$config.log" | grep -oE "[0-9,]+ tok/s \| MFU [0-9.]+% \| peak mem [0-9.]+ GiB")
        echo "$config: planned ${planned:-none}; measured ${measured:-none (see $OUT/strategy_$config.log)}" \
            | tee -a "$OUT/strategies.txt"
    done
    exit 0
fi
cat > "$OUT/one_gpu.yaml" <<'YAML'
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
  zero3_init_flag: true
  zero3_save_16bit_model: true
  offload_optimizer_device: none
  offload_param_device: none
  gradient_accumulation_steps: 1
mixed_precision: fp16
num_machines: 1
num_processes: 1
machine_rank: 0
rdzv_backend: static
same_network: true
use_cpu: false
YAML
common=(--data_dir "$OUT/data" --model_config deepseek-1.3b --seq_len 2048 --micro_batch_size 4 --max_steps 40
        --warmup_steps 10 --lr 3e-4 --log_every 10 --eval_every 0 --eval_tokens 65536 --save_every 0 --gradient_checkpointing)
for precision in fp16 bf16; do
    rm -rf "$OUT/run_$precision"
    timeout 240 accelerate launch --config_file "$OUT/one_gpu.yaml" --mixed_precision "$precision" train.py \
        "${common[@]}" --output_dir "$OUT/run_$precision" 2>&1 | tee "$OUT/run_$precision.log" | grep -E "^(plan|  |batch plan|model:|step [0-9]+/)" || true
done
rm -rf "$OUT/run_moe"
timeout 120 accelerate launch --config_file "$OUT/one_gpu.yaml" --mixed_precision bf16 train.py --data_dir "$OUT/data" \
    --model_config deepseek-v3-mini --seq_len 1024 --micro_batch_size 8 --max_steps 40 --warmup_steps 10 --lr 1e-3 \
    --log_every 10 --eval_every 0 --eval_tokens 65536 --save_every 0 --output_dir "$OUT/run_moe" 2>&1 \
    | tee "$OUT/run_moe.log" | grep -E "^(plan|batch plan|model:|step [0-9]+/)" || true
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for p in ("fp16", "bf16", "moe"):
    m = out / f"run_{p}" / "metrics.jsonl"
    if not m.exists():
        print(f"{p}: no metrics (see {out}/run_{p}.log)"); continue
    r = [json.loads(l) for l in m.read_text().splitlines() if '"loss"' in l]
    last = r[-1]
    extra = f", loss scale {last['loss_scale']:.0f}, skipped {last['skipped_steps']}" if "loss_scale" in last else ""
    extra += f", MaxVio {last['moe_maxvio_mean']:.2f}" if "moe_maxvio_mean" in last else ""
    print(f"{p}: loss {r[0]['loss']:.3f} -> {last['loss']:.3f}, {last['tokens_per_s']:,.0f} tokens/s, MFU {last['mfu']:.1%}, "
          f"peak {max(x['peak_mem_gib'] for x in r):.1f} GiB{extra}")
PY
