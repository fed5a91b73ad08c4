# Source on a GPU machine that has torch/transformers/triton but not LumenRL, from the repo root:
#   python3 -m pip wheel -q --no-deps -w .whl packages/*     # here, before shipping the tree
#   python3 -c "from benchmarks.history import commit; print(commit())" > .whl/COMMIT  # here: recorded commit
#   source benchmarks/gpu_env.sh                              # there
# Installs the shipped LumenRL wheels (pure Python, entry points included) into /tmp/site and
# points full benchmark runs' extra output (history_new.jsonl, per-run JSON) at $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
# TRL and its datasets dependency, for grpo_step_vs_trl's side-by-side TRL run (optional):
#   python3 -m pip download -q --no-deps -d .whl/trl trl==1.16.0 datasets dill multiprocess
if ls .whl/trl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/trl/*.whl \
    || return 1
fi
export PYTHONPATH="/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
export LUMENRL_BENCH_OUT="${OUT:-benchmarks/results}" LUMENRL_CACHE="${LUMENRL_CACHE:-/tmp/lumenrl_cache}"
[ -f .whl/COMMIT ] && export LUMENRL_COMMIT="$(cat .whl/COMMIT)"
