#!/usr/bin/env bash
# A/B of eval passes as it ran: old = ff0a2a0 Python + patches 0001-0015 libs, new = patches/proposed
# (0001-0018) with its Python; alternating runs given as arguments (old1 new1 ...). The paths
# are the dev machine's: a worktree at ff0a2a0, a build of the old series, the work and out dirs.
set -u
W=/work/cache/ab/work
run() { # tag pythonpath libpath
  echo "[$(date +%T)] $1 start load $(cut -d' ' -f1-3 /proc/loadavg)"
  ( cd "$2" && env PYTHONPATH="$2" ${3:+LLAMA_CPP_LIB_PATH=$3} /work/main/.venv/bin/python -m clover_gguf.cli eval passes --layers 2 --threads 1,2 --rounds 5 --work $W --out /work/cache/ab/$1 ) > /work/cache/ab/$1.log 2>&1
  echo "[$(date +%T)] $1 end load $(cut -d' ' -f1-3 /proc/loadavg)"
}
for pair in "$@"; do
  case $pair in
    old*) run $pair /work/wt-old /work/cache/oldbuild/bin ;;
    new*) run $pair /work/main "" ;;
  esac
done
