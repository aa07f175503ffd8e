# Sourced by gpu_suite.sh and multi_gpu.sh (set LOG first): the environment of a GPU-host run
# and run(), which runs one part, logs it, remembers a failure and goes on. DRY=1 prints the
# commands instead of running them.
OUT=${OUT:?set OUT to the directory for results}
PY=${PY:-python3}
export PYTHONPATH=${PYTHONPATH:-src}
mkdir -p "$OUT"
LOG="$OUT/$LOG"
# Wheels in .whl/ (peers carried to a host without network) go to /tmp/site, first on the path.
if [ -z "${DRY:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
status=0

run() {  # name, command...
  local name=$1
  shift
  echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  if [ -n "${DRY:-}" ]; then return; fi
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
}
