#!/usr/bin/env bash
# A/B of eval passes for the series with the backend-sampler patches (0003/0004/0018) and pick samplers
# lent across generations (clover_batch_set_pick) against the series before them (0001-0015 then, with its Python at ff0a2a0): alternating runs given
# as arguments (old-1 new-1 old-2 ...), v3 training paused (SIGSTOP), nothing else running.
# Paths are the dev machine's: OLD_PY a worktree at ff0a2a0, OLD_LIB a build of that series with the
# runtime's flags, NEW_PY this checkout (its .venv runtime built by `clover-gguf runtime build`).
exec bash "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/passes_ab.sh" "$(dirname "${BASH_SOURCE[0]}")" "$@"
