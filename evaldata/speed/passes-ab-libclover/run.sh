#!/usr/bin/env bash
# A/B of eval passes for the series with generation in libclover (0019: the driver on llama.h's
# public API, beside libllama) against the series before it (0001-0018 with its Python at d37287a):
# alternating runs given as arguments (old-1 new-1 old-2 ...), nothing else running.
# Paths are the dev machine's: OLD_PY a worktree at d37287a, OLD_LIB a build of that series with the
# runtime's flags, NEW_PY this checkout (its .venv runtime built by `clover-gguf runtime build`).
exec bash "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/passes_ab.sh" "$(dirname "${BASH_SOURCE[0]}")" "$@"
