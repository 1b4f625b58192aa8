"""The GPU planner: which recipe and placement fit a GPU, how fast and at what quality cost
(`clover-gguf plan`, docs/plan.md). The planner's logic is in plan.planner; the package
re-exports the names the CLI and scripts use, loaded on first use (the planner imports torch,
and `clover-gguf --help` loads plan/commands.py)."""

from __future__ import annotations

__all__ = ["PlanError", "make_plan", "format_plan", "cpu_layers_regex"]


def __getattr__(name):
    if name in ("make_plan", "format_plan", "cpu_layers_regex"):
        from . import planner

        return getattr(planner, name)
    if name == "PlanError":
        from .sizes import PlanError

        return PlanError
    raise AttributeError(name)
