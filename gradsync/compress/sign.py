"""The 1-bit family: signSGD, Signum, EF-SignSGD and 1-bit SGD.

Each sends one sign bit per element, packed (sign(0) counts as +). They differ in what is signed
(the gradient, a local momentum), the scale the signs decode to, and how ranks combine them:
signSGD and Signum by majority vote, the scaled ones by averaging.
"""

from __future__ import annotations

from typing import Any

import torch

from ..wire import pack_bits, packed_nbytes, unpack_bits
from .base import Compressor, Payload, Undoable, check_real
from .scratch import magnitude, scratch


def pack_signs(flat: torch.Tensor) -> torch.Tensor:
    """One bit per element: 1 where flat >= 0, else 0."""
    return pack_bits(nonnegative(flat), 1)


def nonnegative(flat: torch.Tensor) -> torch.Tensor:
    """flat >= 0, in a scratch tensor."""
    return torch.ge(flat, 0, out=scratch("nonnegative", flat.numel(), torch.bool, flat.device))


def decode_signs(packed: torch.Tensor, numel: int, positive: float, negative: float) -> torch.Tensor:
    """A float32 tensor holding `positive` where the bit is set and `negative` elsewhere.

    Arithmetic on the 0/1 codes (bit * (positive - negative) + negative) is several times faster
    than torch.where on the CPU; the set entries may differ from `positive` in the last bit.
    """
    out = unpack_bits(packed, 1, numel).to(torch.float32)
    return out.mul_(positive - negative).add_(negative)


class SignSGD(Compressor):
    """Sends sign(x), one bit per element (Bernstein et al., "signSGD: Compressed Optimisation
    for Non-Convex Problems", ICML 2018; "signSGD with Majority Vote is Communication Efficient
    and Fault Tolerant", ICLR 2019).

    Ranks combine by majority vote: the result is sign(sum of the ranks' signs), +1, -1 or 0 on
    a tie, summed as small integers by one allreduce. The step is thus a unit step per element
    whatever the gradient's scale and the world size: tune the learning rate as for signSGD
    (around 1e-4). One payload decodes to +-1. Biased and without error feedback by design.
    """

    majority_vote = True

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        return (pack_signs(self.signed(x.reshape(-1))),), (x.shape, x.dtype)

    def signed(self, flat: torch.Tensor) -> torch.Tensor:
        """What is signed: the input itself here."""
        return flat

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        shape, dtype = ctx
        return decode_signs(payload[0], shape.numel(), 1.0, -1.0).to(dtype).reshape(shape)

    def payload_bytes(self, numel: int) -> int:
        return packed_nbytes(numel, 1)


class Signum(SignSGD):
    """signSGD with momentum (Bernstein et al., ICML 2018): m <- beta m + (1 - beta) x; send
    sign(m); ranks combine by majority vote.

    The momentum is kept per rank and compression point, so train with a momentum-free
    optimizer. It is kept in two buffers, so a step that turns out non-finite on some rank is
    undone (undo) and leaves no trace.
    """

    def __init__(self, beta: float = 0.9) -> None:
        self.beta = check_real("beta", beta, 0, 1, "[)", "Signum's default is 0.9")
        self._momentum = Undoable("signum momentum")

    def signed(self, flat: torch.Tensor) -> torch.Tensor:
        old, new = self._momentum.update(flat)
        return torch.mul(old, self.beta, out=new).add_(flat, alpha=1 - self.beta)

    def undo(self) -> None:
        self._momentum.undo()

    def rescale_units(self, ratio: float) -> None:
        self._momentum.scale(ratio)  # mixed with the next gradients: the same units

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self._momentum.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._momentum.load(state["momentum"])


class EFSignSGD(Compressor):
    """Sends one sign bit per element and one scale, ||x||_1 / d (Karimireddy et al., "Error
    Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019).

    Decodes to scale * sign(x) with sign(0) = +1. Biased and contractive with
    delta = ||x||_1^2 / (d ||x||_2^2); meant for error feedback. The scale is per rank, so
    payloads are not summable: exchanged by allgather.
    """

    needs_feedback = True

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = x.reshape(-1)
        scale = magnitude(flat).sum(dtype=torch.float32).div_(max(1, flat.numel())).reshape(1)
        return (pack_signs(flat), scale), (x.shape, x.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        packed, scale = payload
        shape, dtype = ctx
        s = float(scale)
        return decode_signs(packed, shape.numel(), s, -s).to(dtype).reshape(shape)

    def payload_bytes(self, numel: int) -> int:
        return packed_nbytes(numel, 1) + 4


class OneBit(Compressor):
    """1-bit SGD (Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014).

    Quantizes at 0 and reconstructs each side with its mean: entries >= 0 decode to the mean of
    the entries >= 0, the others to the mean of the negative ones. Wire: one bit per element
    and the two means (one pair per tensor, where Seide keeps one per matrix column). Biased; the
    residual belongs in error feedback, which this paper introduced.
    """

    needs_feedback = True

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = x.reshape(-1)
        positive = nonnegative(flat)
        num_positive = int(torch.count_nonzero(positive))
        num_negative = flat.numel() - num_positive
        # Each side summed on its own: total - positive_sum cancels when one side dominates.
        part = torch.clamp(flat, min=0, out=scratch("onebit-part", flat.numel(), flat.dtype, flat.device))
        positive_sum = part.sum(dtype=torch.float32)
        negative_sum = torch.clamp(flat, max=0, out=part).sum(dtype=torch.float32)
        means = torch.stack([positive_sum / max(1, num_positive), negative_sum / max(1, num_negative)])
        return (pack_bits(positive, 1), means), (x.shape, x.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        packed, means = payload
        shape, dtype = ctx
        positive, negative = means.tolist()
        return decode_signs(packed, shape.numel(), positive, negative).to(dtype).reshape(shape)

    def payload_bytes(self, numel: int) -> int:
        return packed_nbytes(numel, 1) + 8
