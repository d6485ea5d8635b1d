#!/usr/bin/env bash
# GPU truth, round 3, as one job on an H100 (the GPU of round 1 and its holdout), from the repository root:
#
#     OUT=/some/dir bash benchmarks/gpu_host_h100.sh
#
# 1. the executor's host time per block by regime (executor/profile/host.py) on this machine, added to
#    round 1's raw measurements: $OUT/h100-sxm5.kernels.json, and the profile derived again from them:
#    $OUT/h100-sxm5.toml (with [gpu.kernels] host_us);
# 2. with it, round 1 and its holdout predicted again (they ran before the probe existed, on a machine of
#    this kind) and round 2's holdout predicted for this GPU before any of it runs: $OUT/predicted_*.json;
# 3. the host-bound holdout plans trained here: $OUT/gpu_h100_holdout2_runs.json;
# 4. FP8 against bf16, compiled (torchao from .whl/): $OUT/gpu_fp8_runs.json.
# Each step writes as it goes, so a step stopped at its limit keeps what it finished.
OUT=${OUT:-/tmp/meshplan-h100}
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
date -u +"probe start %FT%TZ"
timeout "${PROBE_S:-170}" python3 -m executor.profile.host --merge profiles/measured/h100-sxm5.kernels.json \
    --out "$OUT/h100-sxm5.kernels.json" 2>&1 | grep -v Warning
python3 -m planner.cli profile --from "$OUT/h100-sxm5.kernels.json" --name measured-h100-sxm5 --out "$OUT/h100-sxm5.toml"
grep host_us "$OUT/h100-sxm5.toml"
date -u +"predict start %FT%TZ"
for set in main holdout holdout2; do
    python3 benchmarks/gpu_validate.py --set $set --predict-only --cluster "$OUT/h100-sxm5.toml" \
        --out "$OUT/predicted_$set.json" | tail -1
done
date -u +"measure start %FT%TZ"
timeout "${MEASURE_S:-150}" python3 benchmarks/gpu_validate.py --measure --set holdout2 \
    --raw "$OUT/gpu_h100_holdout2_runs.json" --only "gpt2-124m mb4 s1k x4 fsdp" "qwen2-0.5b mb8 s1k op" \
    "llama-1b mb2 s2k x2 fsdp" "moe-8e mb2 s4k" "gpt3-760m mb1 s2k x3 fsdp full" "gpt2-355m mb4 s2k every-3" 2>&1 | grep -v Warning
date -u +"fp8 start %FT%TZ"
python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
timeout "${FP8_S:-170}" python3 benchmarks/gpu_validate.py --measure --set fp8 --raw "$OUT/gpu_fp8_runs.json" \
    2>&1 | grep -v Warning
date -u +"done %FT%TZ"
