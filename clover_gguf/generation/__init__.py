"""Generation's front door: ``loader.load(path)`` opens a safetensors model folder (PyTorch
reference) or a ``.gguf`` (llama.cpp runtime) as one Generator interface; ``config`` holds the
one GenerationConfig both backends read; ``run`` and ``commands`` are `clover-gguf run`.

Only ``config`` is imported here: reference/generate.py imports it, and the loader imports the
reference, so importing the loader from this file would make a circle at import time."""

from .config import GenerationConfig

__all__ = ["GenerationConfig"]
