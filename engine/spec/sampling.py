"""Sampling parameters, logits -> probabilities, and the one-uniform sampler.

Everything random in decoding goes through `sample_from_probs` (or, for speculative verification,
through `engine.verify`, which draws its uniforms the same way) with a per-request
`torch.Generator` from `make_generator`. Plain target-only decoding samples each token as

    token = sample_from_probs(process_logits(target_logits, params), generator)

which draws exactly one float64 uniform per token; a speculative round with zero drafts draws the
same single uniform (see `engine.verify.verify_tree`), so K = 0 reproduces plain decoding bit for bit.

SamplingParams(mode="position") replaces the generator by Gumbel noise keyed on (seed, position)
(`engine.spec.gumbel`): the committed text then no longer depends on the speculation at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# V=vocab

__all__ = ["MODES", "SamplingParams", "make_generator", "process_logits", "sample_from_probs"]

_SEED_MODULUS = 2**64  # torch.Generator.manual_seed accepts [0, 2**64)
MODES = ("generator", "position")


@dataclass(frozen=True)
class SamplingParams:
    """How the target distribution is shaped before sampling; one per request.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k:       keep the top_k most likely tokens (0 = off); ties go to the lower token id.
    top_p:       nucleus; keep the smallest most-likely set whose mass >= top_p (1.0 = off).
    seed:        per-request random stream (see `make_generator`); None = nondeterministic.
    mode:        where the randomness of sampling comes from.
                 "generator": the request's `torch.Generator`, uniforms drawn as verification consumes them.
                 "position": the token at absolute position p is argmax(log p_target + g_p) with Gumbel
                 noise keyed on (the request's seed, p) only (`engine.spec.gumbel`, 2408.07978): the text
                 is the same for every K, W, λ, drafter and batch, and drafters propose with that noise.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    mode: str = "generator"

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1], got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise ValueError(f"SamplingParams.seed must be None or an int >= 0, got {s!r}")
        if self.mode not in MODES:
            raise ValueError(f"SamplingParams.mode must be one of {MODES}, got {self.mode!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature == 0); top_k / top_p are then irrelevant."""
        return self.temperature == 0

    @property
    def position_keyed(self) -> bool:
        """Sampling (not greedy) in mode "position": tokens are Gumbel-max samples under keyed noise."""
        return self.mode == "position" and not self.greedy


def row_argmax(x: Tensor) -> list[int] | int:
    """argmax over the last dimension of x [N, V] (a list of N ints) or [V] (an int); first index on ties, NaN wins,
    as `torch.argmax`. CPU float32 / float64 rows go through numpy: torch's CPU argmax over a 4096-word row costs ~15
    µs (~78 µs over 9 rows) against ~3 (~6), measured on the engine's greedy path, where that is a few per cent of a
    small model's decode step."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return x.detach().numpy().argmax(-1).tolist()
    return x.argmax(dim=-1).tolist()


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Logits [..., V] -> float32 probabilities [..., V] after temperature, top-k, then top-p.

    Greedy params give a one-hot at argmax (first index on ties, like `torch.argmax`).
    Otherwise: softmax(logits / temperature); top-k keeps exactly top_k tokens; top-p keeps the
    smallest prefix of the descending order whose mass reaches top_p (always >= 1 token); the result
    is renormalised. The descending order is a stable sort, so among equal logits the lower token id
    ranks first: truncation at a tie is deterministic and the same on every device.
    -inf logits are allowed (masked tokens); NaN logits are the caller's bug and propagate.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    if params.greedy:
        target_argmax = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
        return torch.zeros_like(logits).scatter_(-1, target_argmax, 1.0)

    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k == 0 and params.top_p >= 1.0 and params.temperature == 1.0:
        # the same bits as below: softmax subtracts the max itself, and x - max == (x - max) - 0 exactly
        return torch.softmax(logits, dim=-1)
    # Subtract the max first: a tiny temperature would otherwise overflow logits / t to +-inf.
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    scaled = shifted / params.temperature
    if top_k == 0 and params.top_p >= 1.0:
        return torch.softmax(scaled, dim=-1)

    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [..., V]
    if top_k:
        sorted_logits[..., top_k:] = -math.inf
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    if params.top_p < 1.0:
        # Keep token i iff the mass strictly before it is < top_p; cumsum in float64 so the boundary
        # does not move with float32 rounding. The first token always survives (mass before it = 0).
        mass_before = sorted_probs.double().cumsum(dim=-1) - sorted_probs.double()
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def draw_uniform(generator: torch.Generator | None) -> float:
    """One float64 uniform in [0, 1) from `generator` (None: torch's default generator).

    This is the only way the engine consumes randomness, so streams are easy to reason about.
    """
    device = generator.device if generator is not None else "cpu"
    return torch.rand((), generator=generator, dtype=torch.float64, device=device).item()


def sample_from_probs(probs: Tensor, generator: torch.Generator | None) -> int:
    """Inverse-CDF sample of one token id from non-negative weights probs [V] (need not sum to 1).

    Draws exactly one uniform u (`draw_uniform`) and returns the first index whose float64 cumulative
    sum exceeds u * total. Zero-weight tokens are never returned: their cumulative sum equals their
    predecessor's, so they can never be the first to exceed. If rounding puts u * total at or beyond
    the last cumulative sum, the last non-zero index is returned.
    Raises ValueError for a non-1-D input, negative or non-finite weights, or zero total mass.
    """
    if probs.dim() != 1 or probs.numel() == 0:
        raise ValueError(f"sample_from_probs expects a non-empty 1-D tensor [V], got {tuple(probs.shape)}")
    cdf = probs.to(torch.float64).cumsum(dim=0)  # [V]
    min_weight, total = torch.stack([probs.amin().double(), cdf[-1]]).tolist()  # one sync
    if not (min_weight >= 0 and math.isfinite(total) and total > 0):
        raise ValueError(
            "sample_from_probs needs finite non-negative weights with positive mass, "
            f"got min={min_weight} total={total}"
        )
    u = draw_uniform(generator)  # drawn after validation: a rejected input consumes no randomness
    index = int(torch.searchsorted(cdf, u * total, right=True).item())
    if index >= probs.numel():
        index = int(torch.nonzero(probs > 0)[-1, 0].item())
    return index


def make_generator(seed: int | None, index: int, device: str | torch.device = "cpu") -> torch.Generator:
    """Per-request random stream: seeded with (seed + index) mod 2**64, or nondeterministically.

    `index` is the request's position in the batch, so one seed gives each request its own stream and
    removing a finished request never shifts another's. With seed None the generator is seeded from
    `torch.Generator.seed()` (std::random_device / time), leaving torch's global generator untouched.
    """
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed((int(seed) + int(index)) % _SEED_MODULUS)
    return generator
