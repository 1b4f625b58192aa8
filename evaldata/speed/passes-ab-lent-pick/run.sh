#!/usr/bin/env bash
# A/B of eval passes for the series with the backend-sampler patches (0003/0004/0018) and pick samplers
# lent across generations (clover_batch_set_pick) against the series before them (0001-0015 then, with its Python at ff0a2a0): alternating runs given
# as arguments (old-1 new-1 old-2 ...), v3 training paused (SIGSTOP), nothing else running.
# Paths are the dev machine's: OLD_PY a worktree at ff0a2a0, OLD_LIB a build of that series with the
# runtime's flags, NEW_PY this checkout (its .venv runtime built by `clover-gguf runtime build`).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
W=${W:-/work/cache/ab/work}
OLD_PY=${OLD_PY:-/work/wt-old} OLD_LIB=${OLD_LIB:-/work/cache/oldbuild/bin}
NEW_PY=${NEW_PY:-$(cd "$HERE/../../.." && pwd)}
PY=${PY:-$NEW_PY/.venv/bin/python}
run() { # tag pythonpath libpath
  echo "[$(date +%T)] $1 start load $(cut -d' ' -f1-3 /proc/loadavg)"
  ( cd "$2" && env PYTHONPATH="$2" ${3:+LLAMA_CPP_LIB_PATH=$3} "$PY" -m clover_gguf.cli eval passes --layers 2 \
      --threads 1,2 --rounds 5 --work "$W" --out "$HERE/$1" ) > "$HERE/$1.log" 2>&1
  echo "[$(date +%T)] $1 end load $(cut -d' ' -f1-3 /proc/loadavg)"
}
for tag in "$@"; do
  case $tag in
    old*) run "$tag" "$OLD_PY" "$OLD_LIB" ;;
    new*) run "$tag" "$NEW_PY" "" ;;
  esac
done
