#!/usr/bin/env bash
# GPU truth, round 2, as one job on one lent GPU, from the repository root:
#
#     OUT=/some/dir bash benchmarks/gpu_round2.sh
#
# 1. `meshplan profile --device cuda` of this GPU (the FP8, grouped-GEMM, host-copy and host-per-op
#    measurements included): $OUT/NAME.toml and NAME.kernels.json;
# 2. the round-2 plans predicted with that profile before any of them runs:
#    $OUT/gpu_round2_predicted_inrun.json (the sets predicted with committed profiles before the job
#    are benchmarks/results/gpu_round2_predicted_*.json);
# 3. the round-2 plans trained and measured: $OUT/gpu_round2_runs.json, written after every plan.
# Each step has its own time limit (PROFILE_S, MEASURE_S seconds), so that one that overruns leaves the
# next its time. Wheels under .whl/ (PuLP, highspy: the planner's solver) are installed first where the
# machine reaches no package registry. Then, anywhere:
#     python benchmarks/gpu_validate.py --raw $OUT/gpu_round2_runs.json --cluster $OUT/NAME.toml
OUT=${OUT:-/tmp/meshplan-round2}
source benchmarks/gpu_env.sh
NAME=${NAME:-$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")}
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,clocks.max.mem,driver_version --format=csv \
    > "$OUT/nvidia-smi.csv" 2>&1
python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
date -u +"profile start %FT%TZ"
timeout "${PROFILE_S:-240}" python3 -m planner.cli profile --nproc 1 --device cuda --name "measured-$NAME" \
    --out "$OUT/$NAME.toml" 2>&1 | tail -n 30
date -u +"predict start %FT%TZ"
python3 benchmarks/gpu_validate.py --set round2 --predict-only --cluster "$OUT/$NAME.toml" \
    --out "$OUT/gpu_round2_predicted_inrun.json"
date -u +"measure start %FT%TZ"
timeout "${MEASURE_S:-270}" python3 benchmarks/gpu_validate.py --measure --set round2 --raw "$OUT/gpu_round2_runs.json"
date -u +"done %FT%TZ"
