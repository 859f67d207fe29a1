"""Hydra finds sweepers only inside the ``hydra_plugins`` namespace package; the implementation
lives in ``cascade.sweep``."""

from cascade.sweep import ResumableSweeper as _ResumableSweeper


class ResumableSweeper(_ResumableSweeper):
    """``cascade.sweep.ResumableSweeper`` under the name Hydra's plugin discovery accepts."""
