"""train: clover-tiny's corpus, training loop, exports, checks and model card."""

from ..errors import CloverError


class TrainError(CloverError, ValueError):
    """A training run's input that cannot be used (an option, a folder, a checkpoint); the
    message names it."""
