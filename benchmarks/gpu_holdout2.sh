#!/usr/bin/env bash
# GPU truth, round 2's holdout, as one job on the GPU that ran round 2, from the repository root:
#
#     OUT=/some/dir bash benchmarks/gpu_holdout2.sh
#
# 1. the executor's host time per block by regime (executor/profile/host.py), added to the raw
#    measurements of profiles/measured/h200.kernels.json: $OUT/h200.kernels.json, and the profile
#    derived again from them (`meshplan profile --from`): $OUT/h200.toml (with [gpu.kernels] host_us);
# 2. with that profile, round 2 predicted again (in-sample: the rows the host-bound mechanism was built
#    on) and the holdout set predicted before any of it runs: $OUT/gpu_round2_predicted_host.json,
#    $OUT/gpu_holdout2_predicted_inrun.json;
# 3. the holdout plans trained and measured: $OUT/gpu_holdout2_runs.json, written after every plan.
# Then, anywhere: python benchmarks/gpu_validate.py --raw $OUT/gpu_holdout2_runs.json --cluster $OUT/h200.toml
OUT=${OUT:-/tmp/meshplan-holdout2}
source benchmarks/gpu_env.sh
date -u +"probe start %FT%TZ"
timeout "${PROBE_S:-240}" python3 -m executor.profile.host --merge profiles/measured/h200.kernels.json \
    --out "$OUT/h200.kernels.json" 2>&1 | grep -v Warning
python3 -m planner.cli profile --from "$OUT/h200.kernels.json" --name measured-h200 --out "$OUT/h200.toml"
grep host_us "$OUT/h200.toml"
date -u +"predict start %FT%TZ"
python3 benchmarks/gpu_validate.py --set round2 --predict-only --cluster "$OUT/h200.toml" \
    --out "$OUT/gpu_round2_predicted_host.json"
python3 benchmarks/gpu_validate.py --set holdout2 --predict-only --cluster "$OUT/h200.toml" \
    --out "$OUT/gpu_holdout2_predicted_inrun.json"
date -u +"measure start %FT%TZ"
timeout "${MEASURE_S:-240}" python3 benchmarks/gpu_validate.py --measure --set holdout2 --raw "$OUT/gpu_holdout2_runs.json" \
    2>&1 | grep -v Warning
date -u +"done %FT%TZ"
