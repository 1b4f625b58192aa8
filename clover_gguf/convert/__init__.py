"""safetensors -> GGUF: validate (converter.py), plan (tensor_plan.py), write (pipeline.py + metadata.py)."""

from ..errors import CloverError


class ConvertError(CloverError, RuntimeError):
    """A conversion that cannot proceed; the message names the file/tensor at fault."""
