"""The llama.cpp runtime: build (build.py), ctypes bindings (bindings.py), CloverRuntime
(runtime.py). Importing this package does not load libllama; `CloverRuntime` does."""

from .build import BuildError, build_runtime, runtime_paths

__all__ = ["BuildError", "build_runtime", "runtime_paths", "CloverRuntime", "RuntimeBackend", "RuntimeNotBuilt"]


def __getattr__(name):
    if name in ("CloverRuntime", "RuntimeBackend", "RuntimeNotBuilt"):
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(name)
