#!/usr/bin/env bash
# The whole pipeline on the CPU, offline, once the packages are installed
# (4:19-6:33 on an AMD EPYC with bf16 units, two sessions; on CPUs without them not timed since Muon became the default for mini).
#   1. prepare_data.py: the built-in python-docs corpus, a 4096-token byte-level BPE trained on it
#   2. train.py: a 5M-parameter DeepSeek-architecture model, 3 CPU processes under DeepSpeed ZeRO-3, 300 steps
#   3. eval.py: perplexity of the exported model on the held-out documents, and a sample of what it writes
# Run it with `make quickstart` (which sets up .venv), or directly in an environment that has requirements.txt.
set -euo pipefail
cd "$(dirname "$0")"
DATA=data/python-docs
OUT=runs/quickstart
# A CPU pipeline: say so to DeepSpeed, which otherwise warns on every process that it found no GPU.
export DS_ACCELERATOR=cpu

# bf16 only where the CPU has bf16 units (Intel AMX or AVX512-BF16); elsewhere bf16 matmuls are far slower than fp32.
if grep -qwE 'amx_bf16|avx512_bf16' /proc/cpuinfo 2>/dev/null; then
    PRECISION=(--mixed_precision bf16); echo "quickstart: this CPU has bf16 units ($(grep -owE 'amx_bf16|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')): training in bf16"
else
    PRECISION=(); echo "quickstart: this CPU has no bf16 units (no AMX, no AVX512-BF16): training in fp32"
fi

python prepare_data.py --dataset python-docs --tokenizer bpe:4096 --output_dir "$DATA" --validation_fraction 0.05 --overwrite
rm -rf "$OUT"  # a fresh demo each time; real runs continue with --resume auto instead
# One thread per process (3 processes share the cores); torchrun would set the same and print a banner about it.
OMP_NUM_THREADS=1 accelerate launch --config_file accelerate_configs/zero3_cpu.yaml "${PRECISION[@]}" train.py \
    --data_dir "$DATA" --model_config mini --output_dir "$OUT" \
    --seq_len 128 --micro_batch_size 8 --max_steps 300 --warmup_steps 30 --lr 2e-3 \
    --log_every 25 --eval_every 100 --save_every 100
python eval.py --model "$OUT/final" --dataset "$DATA" --split validation --max_length 512 --output_json "$OUT/eval_validation.json"
# What the trained model writes (README, "Results"): greedy, so the same text on every machine that computes alike.
python eval.py --model "$OUT/final" --prompt "The for statement" --temperature 0 --max_new_tokens 40 --output_json "$OUT/sample.json"

python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
val = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if "val_loss" in l]
train = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
ev = json.loads((out / "eval_validation.json").read_text())
print("\n=== quickstart results (held-out python-docs documents) ===")
print(f"validation perplexity, untrained (step 0):   {val[0]['val_ppl']:10.1f}")
print(f"validation perplexity, trained (step {val[-1]['step']}):  {val[-1]['val_ppl']:10.1f}")
print(f"eval.py on the exported model: token ppl {ev['token_perplexity']:.2f}, byte ppl {ev['byte_perplexity']:.3f}, "
      f"bits/byte {ev['bits_per_byte']:.3f}, word ppl {ev['word_perplexity']:.1f}")
print(f"training throughput (last log line): {train[-1]['tokens_per_s']:,.0f} tokens/s, MFU {train[-1]['mfu']:.1%}")
print(f"loss curve:      {out / 'loss_curve.png'}")
print(f"exported model:  {out / 'final'}  (AutoModelForCausalLM.from_pretrained)")
PY
# The README's "go on from 300 to 600 steps", with the precision this run trained in (a resume keeps it).
echo "to go on to 600 steps: accelerate launch --config_file accelerate_configs/zero3_cpu.yaml ${PRECISION[*]:+${PRECISION[*]} }train.py --output_dir $OUT --max_steps 600 --lr_decay_steps 600 --resume auto"
