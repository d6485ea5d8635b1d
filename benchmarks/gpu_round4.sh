#!/usr/bin/env bash
# GPU truth, round 4: the three measurements the open issues wait for, as one short job on an H100 or H200, from
# the repository root (about 9 minutes; each step writes as it goes, so a step stopped at its limit keeps what
# it finished):
#
#     OUT=/some/dir bash benchmarks/gpu_round4.sh
#
# 1. FP8 casts, compiled: the column-wise amax and cast that torchao's rowwise recipe fuses into its backward
#    (executor/profile/kernels.py fp8_casts) and the strided-reduction rate it implies
#    (executor/profile/toml.py strided_reduce_lines): $OUT/fp8_casts.json. h100-80g's 368 GB/s is fitted on one
#    trace (benchmarks/fp8_strided_rate.py); this measures the kernel itself.
# 2. The executor's host time per block (executor/profile/host.py, six runs) merged into the machine's stored
#    raw measurements, and the profile derived again: $OUT/<name>.kernels.json, $OUT/<name>.toml.
# 3. The host-bound GPT-2 rows of round 1 (issue 24: `gpt2-124m mb2x4 s2k` predicted +18% fast) trained again,
#    and compiled Llama 3.2 3B with tensorwise and rowwise FP8 (torchao from .whl/): $OUT/gpu_round4_runs.json,
#    $OUT/gpu_round4_fp8_runs.json.
# 4. Round 2's two MoE plans without FSDP again, after the executor's experts stopped writing a whole-stack
#    gradient per expert and run as one grouped GEMM under autocast (executor/moe.py grouped_product; they
#    ran 2.3 and 3.7 times the planner's kernel time): $OUT/gpu_round4_moe_runs.json.
OUT=${OUT:-/tmp/meshplan-round4}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
    *H200*) NAME=h200 ;;
    *) NAME=h100-sxm5 ;;
esac
date -u +"casts start %FT%TZ"
timeout "${CASTS_S:-90}" python3 - "$OUT/fp8_casts.json" "profiles/measured/$NAME.toml" <<'EOF'
import json, sys, tomllib
from executor.profile.kernels import fp8_casts
from executor.profile.toml import strided_reduce_lines
rows = fp8_casts("cuda", tokens=8192, hidden=4096, compiled=True)
eager = tomllib.load(open(sys.argv[2], "rb"))["gpu"]["kernels"]["eager_GBps"]
lines = strided_reduce_lines(rows, {k: v * 1e9 for k, v in eager.items()}, "measured: benchmarks/gpu_round4.sh")
json.dump({"rows": rows, "profile_lines": lines}, open(sys.argv[1], "w"), indent=1)
for r in rows:
    print(r.get("kernel"), r.get("GBps", r.get("error")))
print("\n".join(lines) or "no strided rate: the compiled column-wise cast did not run")
EOF
date -u +"probe start %FT%TZ"
timeout "${PROBE_S:-170}" python3 -m executor.profile.host --merge "profiles/measured/$NAME.kernels.json" \
    --out "$OUT/$NAME.kernels.json" 2>&1 | grep -v Warning
python3 -m planner.cli profile --from "$OUT/$NAME.kernels.json" --name "measured-$NAME" --out "$OUT/$NAME.toml"
grep host_us "$OUT/$NAME.toml"
date -u +"measure start %FT%TZ"
timeout "${MEASURE_S:-120}" python3 benchmarks/gpu_validate.py --measure --raw "$OUT/gpu_round4_runs.json" \
    --only "gpt2-124m mb2x4 s2k" "gpt2-124m mb8 s2k" 2>&1 | grep -v Warning
date -u +"fp8 start %FT%TZ"
timeout "${FP8_S:-130}" python3 benchmarks/gpu_validate.py --measure --set fp8 --raw "$OUT/gpu_round4_fp8_runs.json" \
    --only "llama-3b mb1 s4k compiled fp8-tensorwise" "llama-3b mb1 s4k compiled fp8-rowwise" 2>&1 | grep -v Warning
date -u +"moe start %FT%TZ"
timeout "${MOE_S:-80}" python3 benchmarks/gpu_validate.py --measure --set round2 --raw "$OUT/gpu_round4_moe_runs.json" \
    --only "moe-8e mb4 s2k" "moe-32e mb2 s4k sel" 2>&1 | grep -v Warning
date -u +"done %FT%TZ"
