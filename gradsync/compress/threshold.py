"""Threshold sparsification: every entry whose magnitude reaches a fixed threshold."""

from __future__ import annotations

import math

import torch

from ..wire import index_nbytes
from .base import check_real
from .sparse import Sparsifier, magnitude_at_least


class Threshold(Sparsifier):
    """Sends the entries with |x_i| >= threshold and their indices (Strom, "Scalable Distributed
    DNN Training Using Commodity GPU Cloud Computing", Interspeech 2015).

    The count depends on the data, so payload sizes vary from rank to rank and step to step
    (fixed_size = False: the exchange trades sizes first). Biased; meant for error feedback,
    which lets small entries accumulate until they pass. payload_bytes(numel) is the largest
    payload, every entry kept. The threshold applies to what the codec receives: each rank's
    gradient already divided by the world size.

    Example:
        >>> c = Threshold(threshold=1.0)
        >>> payload, ctx = c.compress(torch.tensor([0.5, -2.0, 1.0, 0.1]))
        >>> c.decompress(payload, ctx)
        tensor([ 0., -2.,  1.,  0.])
    """

    fixed_size = False
    needs_feedback = True

    def __init__(self, threshold: float = 1e-3) -> None:
        self.threshold = check_real("threshold", threshold, 0, math.inf, "()", "a magnitude such as 1e-3")

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        return magnitude_at_least(flat, self.threshold, expected=flat.numel() // 64)

    def payload_bytes(self, numel: int) -> int:
        return index_nbytes(numel, numel) + 4 * numel
