# Sourced by the GPU jobs (benchmarks/gpu_round2.sh, gpu_holdout2.sh) from the repository root: $OUT made,
# the wheels under .whl/ (PuLP, highspy: the planner's solver) installed where the machine reaches no
# package registry, and this checkout first on the Python path, its output unbuffered.
set -u
OUT=${OUT:-/tmp/meshplan-gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
