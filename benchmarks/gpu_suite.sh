#!/usr/bin/env bash
# The GPU benchmark suite, for one GPU and under 8 minutes:
#   1. matmul peak probe: best bf16 torch.mm throughput against the datasheet peak
#   2. `gpuflow train --workload textlm` at --model-size 124m and 1b, bf16, --compile, one
#      GPU, synthetic data, a fixed number of steps; tokens/s and MFU from each summary.json
#      (AdamW runs with fused kernels on CUDA by default)
#   3. benchmarks/serving.py, when present
# Everything goes into one file: benchmarks/results/gpu_suite-<host>.json.
# Targets on one H200 (dense bf16 peak 989 TFLOP/s): MFU >= 45% at 124m, >= 50% at 1b.
#
#   bash benchmarks/gpu_suite.sh             # on the GPU machine
#   bash benchmarks/gpu_suite.sh --dry-run   # the same steps on the CPU, tiny sizes (CI)
#
# GPUFLOW_SUITE_OUT and GPUFLOW_SUITE_WORKDIR override the result file and scratch folder.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
HOST=$(hostname -s 2>/dev/null || hostname)
OUT=${GPUFLOW_SUITE_OUT:-benchmarks/results/gpu_suite-$HOST.json}
WORK=${GPUFLOW_SUITE_WORKDIR:-$(mktemp -d -t gpuflow-suite-XXXXXX)}
mkdir -p "$WORK"
export GPUFLOW_CACHE_DIR=${GPUFLOW_CACHE_DIR:-$WORK/cache}

if (( DRY_RUN )); then
  # No --compile: a cold compile costs 15-30 s per model on a CPU and proves nothing there.
  DEVICE=cpu; SIZES=(tiny); STEPS=6; LOG_EVERY=2; MATMUL_SIZES=256; COMPILE=()
  declare -A BATCH=([tiny]=4); TRAIN_TIMEOUT=300; SERVING_FLAGS=(--quick)
else
  DEVICE=cuda; SIZES=(124m 1b); STEPS=120; LOG_EVERY=10; MATMUL_SIZES=4096,8192,16384
  COMPILE=(--compile)
  declare -A BATCH=([124m]=32 [1b]=8); TRAIN_TIMEOUT=240; SERVING_FLAGS=()
fi
started=$(date +%s)
log() { echo "[gpu_suite +$(( $(date +%s) - started ))s] $*" >&2; }

log "1/3 matmul peak probe on $DEVICE (sizes $MATMUL_SIZES)"
"$PY" - "$DEVICE" "$MATMUL_SIZES" > "$WORK/matmul.json" <<'EOF'
import json, sys, time
import torch
device, sizes = torch.device(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
def sync():
    if device.type == "cuda":
        torch.cuda.synchronize(device)
best = {}
for n in sizes:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.mm(a, b); sync()
    reps, fastest = 10, float("inf")
    for _ in range(5):
        begin = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        fastest = min(fastest, (time.perf_counter() - begin) / reps)
    best[n] = 2 * n**3 / fastest / 1e12
name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
print(json.dumps({"device_name": name, "bf16_tflops_by_size": best,
                  "bf16_tflops": max(best.values())}))
EOF

runs=()
for size in "${SIZES[@]}"; do
  label=$size; run_dir="$WORK/textlm-$label"
  log "2/3 gpuflow train textlm $size (batch ${BATCH[$size]}, $STEPS steps) on $DEVICE"
  timeout "$TRAIN_TIMEOUT" "$PY" -m gpuflow.cli train --workload textlm --data synthetic \
    --model-size "$size" --device "$DEVICE" --precision bf16 "${COMPILE[@]}" \
    --batch-size "${BATCH[$size]}" --max-steps "$STEPS" --log-every "$LOG_EVERY" \
    --warmup-steps 10 --eval-every 0 --no-progress --run-dir "$run_dir" \
    > "$WORK/train-$label.log" 2>&1 || log "textlm $size failed: see $WORK/train-$label.log"
  rm -rf "$run_dir/checkpoints"  # a 1b checkpoint is ~15 GB and says nothing about speed
  runs+=("$label=$run_dir")
done

serving_json="$WORK/serving.json"
if [[ -f benchmarks/serving.py ]]; then
  log "3/3 serving benchmark"
  timeout 150 "$PY" benchmarks/serving.py "${SERVING_FLAGS[@]}" --out "$serving_json" \
    > "$WORK/serving.log" 2>&1 || log "serving benchmark failed: see $WORK/serving.log"
else
  log "3/3 benchmarks/serving.py not present: skipped"
fi

"$PY" - "$OUT" "$DRY_RUN" "$WORK" "$serving_json" "${runs[@]}" <<'EOF'
import datetime, json, socket, sys
from pathlib import Path
import torch
out, dry_run, work, serving, runs = (Path(sys.argv[1]), sys.argv[2] == "1", Path(sys.argv[3]),
                                     Path(sys.argv[4]), sys.argv[5:])
TARGETS = {"124m": 0.45, "1b": 0.50}
train = []
for item in runs:
    label, run_dir = item.split("=", 1)
    summary_path = Path(run_dir) / "summary.json"
    entry = {"model_size": label, "run_dir": run_dir}
    if summary_path.is_file():
        s = json.loads(summary_path.read_text())
        med = s["median"]
        entry.update({
            "tokens_per_s": med["tokens_per_s"], "mfu": med["mfu"],
            "step_time_s": med["step_time_s"], "data_wait_frac": med["data_wait_frac"],
            "peak_flops": s["peak_flops"], "peak_flops_source": s["peak_flops_source"],
            "peak_mem_bytes": s["peak_mem_bytes"], "compiled": s["compiled"],
            "global_batch": s["global_batch"], "steps": s["steps"],
            "device_name": s["device_name"], "config": s["config"],
        })
        if label in TARGETS and med["mfu"] is not None:
            entry["target"] = {"mfu_min": TARGETS[label], "met": med["mfu"] >= TARGETS[label]}
    else:
        log = work / f"train-{label}.log"
        entry["error"] = log.read_text()[-2000:] if log.is_file() else "no summary.json"
    train.append(entry)
result = {
    "benchmark": "gpu_suite",
    "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "command": "bash benchmarks/gpu_suite.sh" + (" --dry-run" if dry_run else ""),
    "dry_run": dry_run,
    "machine": {"hostname": socket.gethostname(),
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
    "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
    "matmul": json.loads((work / "matmul.json").read_text()),
    "train": train,
    "serving": json.loads(serving.read_text()) if serving.is_file() else None,
}
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(result, indent=2) + "\n")
for entry in train:
    mfu = entry.get("mfu")
    print(f"textlm {entry['model_size']}: "
          + (f"{entry['tokens_per_s']:,.0f} tokens/s, MFU "
             + ("n/a" if mfu is None else f"{100 * mfu:.1f}%") if "error" not in entry
             else "FAILED"))
print(f"matmul bf16: {result['matmul']['bf16_tflops']:.1f} TFLOP/s; results in {out}")
EOF
log "done"
