#!/usr/bin/env bash
# Interleaved A/B of `clover-gguf eval passes` between an old build and this checkout:
#   bash scripts/passes_ab.sh OUT old-1 new-1 old-2 new-2 ...
# runs the tags in order (OUT/TAG/passes.json, OUT/TAG.log); compare them with
# `python scripts/compare_passes_ab.py OUT`. Keep the machine quiet (pause training with SIGSTOP).
# old = OLD_PY (a worktree of the old commit) with OLD_LIB (a build of its series with the runtime's
# flags); new = NEW_PY (default: this checkout, its .venv runtime built by `clover-gguf runtime build`).
# W holds the synthetic GGUFs (made on the first run); LAYERS (default 2,4) and THREADS (default 1,2).
set -u
[ $# -ge 2 ] || { sed -n '2,8p' "$0"; exit 2; }
OUT="$(cd "$1" && pwd)"
shift
W=${W:-/work/cache/ab/work}
OLD_PY=${OLD_PY:-/work/wt-old} OLD_LIB=${OLD_LIB:-/work/cache/oldbuild/bin}
NEW_PY=${NEW_PY:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
PY=${PY:-$NEW_PY/.venv/bin/python}
run() { # tag pythonpath libpath
  echo "[$(date +%T)] $1 start load $(cut -d' ' -f1-3 /proc/loadavg)"
  ( cd "$2" && env PYTHONPATH="$2" ${3:+LLAMA_CPP_LIB_PATH=$3} "$PY" -m clover_gguf.cli eval passes --layers "${LAYERS:-2,4}" \
      --threads "${THREADS:-1,2}" --rounds 5 --work "$W" --out "$OUT/$1" ) > "$OUT/$1.log" 2>&1
  echo "[$(date +%T)] $1 end load $(cut -d' ' -f1-3 /proc/loadavg)"
}
for tag in "$@"; do
  case $tag in
    old*) run "$tag" "$OLD_PY" "$OLD_LIB" ;;
    new*) run "$tag" "$NEW_PY" "" ;;
  esac
done
