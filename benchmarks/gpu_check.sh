#!/usr/bin/env bash
# GPU check, run on a CUDA machine from the repository root: bash benchmarks/gpu_check.sh [SIZE_MIB]
# Section "order" (GPU_CHECK_SECTIONS, default "order health stall sharded fsdp2 tier"):
# 0. benchmarks/gpu_snapshot_order.py: a save's BatchNorm statistics are those at save time although the
#    next forward runs while the save's copies are in flight (a tracked model's buffers go first).
# Section "stall":
# 1. measures pinned device-to-host bandwidth (cudaHostRegister'd host memory, as air_core pins it);
# 2. runs benchmarks/checkpoint_stall.py on the GPU with a multi-GB state (default 8192 MiB);
# 3. prints the blocking time next to the bound state size / pinned bandwidth.
# Section "sharded":
# 4. runs benchmarks/sharded_save.py with CUDA tensors: FSDP2 on one GPU (world 1, NCCL + gloo), stock
#    Lightning sharded save vs DCP async_save vs air_core.dcp, SHARDED_MIB of state (default 2048),
#    bounded to 5 minutes.
# Section "fsdp2":
# 5. runs benchmarks/gpu_fsdp2.py: AirModelParallelStrategy and AirFSDPStrategy (FSDP1) on every visible
#    GPU (sharded saves, a resume checked tensor by tensor) and, with 2+ GPUs, AirAccelerator with FSDP2
#    (save_state, load_state).
# Section "health":
# 6. `air preflight` on this node (the real nvidia-smi path: ECC, row remapping, throttling, GPU count)
#    and, with 2+ GPUs, under torchrun on every GPU (links and all-reduce over NCCL, clocks);
# 7. the straggler section timer with CUDA events around a GPU matmul (against a synchronized wall
#    clock of the same work).
# Section "tier" (the local tier, issue 28):
# 8. benchmarks/tier_write.py --device cuda: a local save of TIER_MIB (default 4096) of CUDA state into
#    /dev/shm: how long the call held the loop (the snapshot: device memory into pinned host buffers)
#    and to commit, recycled files against new ones, torch.save for reference;
# 9. benchmarks/goodput_failures.py --cuda: the Accelerate job on the GPU (width TIER_WIDTH, default
#    4096: a 604 MB state), the tier's step slowdown at local_every 50 / 200 / 400, lost steps and
#    goodput under SIGKILLs with and without the tier, restore from the own tier and a partner's copy
#    (over gloo from host memory: the lent machine has one GPU, and NCCL takes one rank per GPU).
# Output also lands in $OUT (if set) as order.txt, gpu_check.json, gpu_check.txt, sharded_save.txt,
# fsdp2.txt, health.txt and tier.txt.
#   GPU_CHECK_SECTIONS=sharded bash benchmarks/gpu_check.sh     # the sharded benchmark only
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE_MIB="${1:-8192}"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-/tmp}"
SECTIONS=" ${GPU_CHECK_SECTIONS:-order health stall sharded fsdp2 tier} "
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ "$SECTIONS" == *" order "* ]]; then
  timeout 120 "$PY" benchmarks/gpu_snapshot_order.py --dir "${BENCH_DIR:-/tmp}/air-snapshot-order" \
      | tee "$OUT_DIR/order.txt"
fi
if [[ "$SECTIONS" == *" health "* ]]; then
{
  set +e  # a warn (1) or bad node (2) is a result to print, not a reason to stop
  "$PY" -m air_core.cli preflight "${BENCH_DIR:-/tmp}/air-preflight" --json "$OUT_DIR/preflight.json"
  echo "air preflight exit: $?"
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  if [[ "$NGPU" -ge 2 ]]; then
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m air_core.cli preflight \
        "${BENCH_DIR:-/tmp}/air-preflight"
    echo "air preflight (torchrun, $NGPU ranks) exit: $?"
  fi
  set -e
  "$PY" - <<'PYEOF'
import time, torch
from air_core.health.stragglers import SectionTimer
a = torch.randn(4096, 4096, device="cuda")
a @ a
torch.cuda.synchronize()
timer, wall = SectionTimer(), []
for _ in range(5):
    t = time.perf_counter()
    timer.start()
    for _ in range(10):
        a @ a
    timer.stop()
    timer.end_step()
    torch.cuda.synchronize()
    wall.append(time.perf_counter() - t)
print(f"straggler section, CUDA events: {[round(x * 1e3, 2) for x in timer.take_window()]} ms")
print(f"same work, synchronized wall:   {[round(x * 1e3, 2) for x in wall]} ms")
PYEOF
} 2>&1 | tee "$OUT_DIR/health.txt"
fi
if [[ "$SECTIONS" == *" stall "* ]]; then
"$PY" - <<'PYEOF' | tee "$OUT_DIR/gpu_check.txt"
import torch, time
assert torch.cuda.is_available(), "no CUDA device"
n = 1 << 30
src = torch.empty(n, dtype=torch.uint8, device="cuda")
host = torch.empty(n, dtype=torch.uint8)
torch.cuda.cudart().cudaHostRegister(host.data_ptr(), n, 0)
for _ in range(2):
    host.copy_(src, non_blocking=True)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(5):
    host.copy_(src, non_blocking=True)
torch.cuda.synchronize()
bw = 5 * n / (time.perf_counter() - t)
print(f"device: {torch.cuda.get_device_name()}")
print(f"pinned D2H bandwidth: {bw / 1e9:.1f} GB/s")
open("/tmp/air_d2h_bw", "w").write(str(bw))
PYEOF
"$PY" benchmarks/checkpoint_stall.py --device cuda --size-mib "$SIZE_MIB" --dir "${BENCH_DIR:-/tmp}" \
    --load idle --methods torch.save lightning_async dcp_async_save air_thread air_process --json \
    > "$OUT_DIR/gpu_check.json"
"$PY" - "$OUT_DIR/gpu_check.json" <<'PYEOF' | tee -a "$OUT_DIR/gpu_check.txt"
import json, sys
rows = json.load(open(sys.argv[1]))["idle"]
bw = float(open("/tmp/air_d2h_bw").read())
sys.path.insert(0, "benchmarks")
from checkpoint_stall import print_table
print_table(rows)
for method in ("air_thread", "air_process"):
    r = rows[method]
    bound = r["state_mib"] * (1 << 20) / bw
    print(f"{method}: blocking {r['blocking_seconds']:.3f} s; state / pinned D2H bandwidth = {bound:.3f} s "
          f"({r['blocking_seconds'] / bound:.2f}x the bound)")
PYEOF
fi
if [[ "$SECTIONS" == *" sharded "* ]]; then
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
timeout 300 "$PY" benchmarks/sharded_save.py --device cuda --worlds 1 --size-mib "${SHARDED_MIB:-2048}" \
    --saves 2 --dir "${BENCH_DIR:-/tmp}" | tee "$OUT_DIR/sharded_save.txt"
fi
if [[ "$SECTIONS" == *" fsdp2 "* ]]; then
NGPU="$("$PY" -c "import torch; print(torch.cuda.device_count())")"
timeout 240 "$PY" benchmarks/gpu_fsdp2.py lightning "${BENCH_DIR:-/tmp}/air-fsdp2-lightning" | tee "$OUT_DIR/fsdp2.txt"
timeout 240 "$PY" benchmarks/gpu_fsdp2.py lightning-fsdp1 "${BENCH_DIR:-/tmp}/air-fsdp1-lightning" \
    | tee -a "$OUT_DIR/fsdp2.txt"
timeout 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" benchmarks/gpu_fsdp2.py \
    accelerate "${BENCH_DIR:-/tmp}/air-fsdp2-accelerate" | tee -a "$OUT_DIR/fsdp2.txt"
fi
if [[ "$SECTIONS" == *" tier "* ]]; then
{
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
  timeout 240 "$PY" benchmarks/tier_write.py --device cuda --size-mib "${TIER_MIB:-4096}" --saves 3
  timeout 480 "$PY" benchmarks/goodput_failures.py --cuda --json --width "${TIER_WIDTH:-4096}" --steps 600 \
      --remote-every 200 --local-every 50 --failures 2
} 2>&1 | tee "$OUT_DIR/tier.txt"
fi
