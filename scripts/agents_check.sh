#!/usr/bin/env bash
# Run real coding agents against `clover-gguf serve` behind a recording reverse proxy and write
# what they sent, what the server answered and how each run ended to evaldata/agents/
# (agents.json, agents.md). The agents (Claude Code, Codex CLI, opencode, Qwen Code, aider,
# mini-swe-agent, OpenHands SDK) are installed from npm / PyPI into $AGENTS_DIR (default
# ~/.cache/clover-gguf/agents) on first use and reused after; the project's venv is untouched.
#
#   scripts/agents_check.sh                                  # all agents, clover-tiny-v3-wip Q8_0
#   scripts/agents_check.sh --only opencode,aider --timeout 300 --keep out/agents
#   scripts/agents_check.sh --model out/tiny.gguf --threads 1 --ctx 65536 --max-steps 10
#   scripts/agents_check.sh --install-only                   # just install / check the agents
#
# Options (scripts/agents_check.py --help): --only A[,B], --model GGUF, --timeout S (300),
# --keep DIR (proxy logs, bodies, sandboxes), --threads N (1), --ctx N (65536), --n-predict N
# (2048), --max-steps N (10), --api-key KEY, --agents-dir DIR, --out DIR, --no-install,
# --install-only, --python312 PATH, --fresh. Agents run one at a time, each with a fresh server.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
export AGENTS_CHECK_ARGV0="scripts/agents_check.sh"
exec python scripts/agents_check.py "$@"
