#!/usr/bin/env bash
# Run eight agent frameworks' own tool loops against `clover-gguf serve` behind a recording proxy
# and write what came back to evaldata/frameworks/ (frameworks.json, frameworks.md): per framework
# and mode (non-streamed, streamed), the loops that ran without an exception, the HTTP statuses,
# the tool calls the server returned and how many validate against the tools' JSON schemas, the
# tool results sent back. The frameworks (openai, openai-agents, smolagents, langchain/langgraph,
# litellm, llm, pydantic-ai, instructor) are installed from PyPI into venvs of their own under
# $FRAMEWORKS_DIR (default ~/.cache/clover-gguf/frameworks) on first use and reused after; the
# project's venv is untouched.
#
#   scripts/frameworks_check.sh                               # all eight, 10 loops a mode
#   scripts/frameworks_check.sh --only litellm,llm --loops 3 --keep out/frameworks
#   scripts/frameworks_check.sh --modes streamed --turns 6 --model out/tiny.gguf
#   scripts/frameworks_check.sh --install-only                # just install / check the frameworks
#
# Options (scripts/frameworks_check.py --help): --only A[,B], --modes M[,M], --loops N (10),
# --turns N (4), --model GGUF, --threads N (1), --ctx N (8192), --n-predict N (512), --api-key KEY,
# --timeout S, --loop-timeout S, --frameworks-dir DIR, --python PATH, --out DIR, --keep DIR,
# --no-install, --install-only, --fresh, --report-only. One framework at a time, each with a
# fresh server.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
export FRAMEWORKS_CHECK_ARGV0="scripts/frameworks_check.sh"
exec python scripts/frameworks_check.py "$@"
