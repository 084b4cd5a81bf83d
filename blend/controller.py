"""Loading controller: pick the recompute ratio that hides under the KV load (CacheBlend sec. 5).

Loading a chunk's KV costs bytes / tier bandwidth; recomputing a fraction r of its tokens costs
about (full layers + r * the other layers) / layers of a full prefill. When the load is the slower
of the two, recomputing more tokens is free in wall time and buys quality, so::

    load_s     = sum(bytes per tier / bandwidth of that tier)
    full_s     = tokens * prefill seconds per token
    fixed_s    = full_s * full_layers / layers              layer 0 + the check layer's q/k/v
    r_hidden   = (load_s - fixed_s) / (full_s * (layers - full_layers) / layers)
    r          = clamp(max(floor, r_hidden), floor, ceiling)

The floor is the quality floor (the paper's 15%): the controller never goes below it, only above
when the load leaves room. Bandwidths and prefill speed are measured, not configured: each load
and each prefill the engine times feeds an exponential moving average.

This engine loads a chunk's whole block (all layers) in one Get, so the load and the recompute
run one after the other here; the ratio is the one that *would* hide under a layer-pipelined load,
and `RatioChoice` reports both times so the caller can see the balance.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Ratio:
    """The fraction of chunk tokens a blend recomputes, as chosen: ``value`` in [0, 1], fixed, or
    None (`Ratio.AUTO`, written ``"auto"``): the loading controller picks it for each blend
    (`LoadingController.choose`). Building one is the one check of a ratio's range (ValueError);
    settings and requests build theirs where they are read."""

    value: float | None = None
    AUTO: ClassVar["Ratio"]

    def __post_init__(self) -> None:
        if self.value is not None:
            if not 0.0 <= self.value <= 1.0:
                raise ValueError(f"ratio must be in [0, 1], got {reprlib.repr(self.value)}")
            object.__setattr__(self, "value", float(self.value))

    @property
    def auto(self) -> bool:
        """True: the loading controller decides; False: ``value`` is the ratio."""
        return self.value is None

    @classmethod
    def parse(cls, value: object) -> "Ratio":
        """A ratio as a client or a file writes it: a number in [0, 1], or ``"auto"``."""
        if isinstance(value, str) and value == "auto":
            return cls.AUTO
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f'ratio must be a number in [0, 1] or "auto", got {reprlib.repr(value)}')
        return cls(value)


Ratio.AUTO = Ratio()


@dataclass(frozen=True)
class ControllerConfig:
    floor: float = 0.15          # never recompute less than this fraction of chunk tokens
    ceiling: float = 1.0
    full_layers: float = 1.3     # layer 0 in full + the check layer's projections, in layer units
    smoothing: float = 0.3       # weight of a new measurement in the moving averages

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor <= self.ceiling <= 1.0:
            raise ValueError(f"need 0 <= floor <= ceiling <= 1, got floor={self.floor}, ceiling={self.ceiling}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if self.full_layers < 0:
            raise ValueError(f"full_layers must be >= 0, got {self.full_layers}")


@dataclass(frozen=True)
class RatioChoice:
    ratio: float
    load_s: float        # estimated load time of the chunks
    recompute_s: float   # estimated blended-prefill compute at `ratio`
    reason: str          # "floor", "hidden" (raised to hide under the load), "ceiling", "unmeasured"


@dataclass
class LoadingController:
    num_layers: int
    config: ControllerConfig = field(default_factory=ControllerConfig)
    bandwidth: dict[str, float] = field(default_factory=dict)  # tier -> bytes per second
    prefill_s_per_token: float | None = None

    def __post_init__(self) -> None:
        if self.num_layers <= self.config.full_layers:
            raise ValueError(f"num_layers ({self.num_layers}) must exceed full_layers ({self.config.full_layers})")

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.config.smoothing) * old + self.config.smoothing * new

    def observe_load(self, tier: str, num_bytes: int, seconds: float) -> None:
        """Record a measured load of ``num_bytes`` from ``tier``."""
        if num_bytes > 0 and seconds > 0:
            self.bandwidth[tier] = self._average(self.bandwidth.get(tier), num_bytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Record a measured full prefill of ``tokens`` tokens."""
        if tokens > 0 and seconds > 0:
            self.prefill_s_per_token = self._average(self.prefill_s_per_token, seconds / tokens)

    def recompute_seconds(self, tokens: int, ratio: float) -> float:
        full_s = tokens * (self.prefill_s_per_token or 0.0)
        fixed = self.config.full_layers / self.num_layers
        return full_s * (fixed + ratio * (1 - fixed))

    def choose(self, tokens: int, bytes_per_tier: dict[str, int]) -> RatioChoice:
        """The ratio for blending ``tokens`` chunk tokens whose KV comes from ``bytes_per_tier``."""
        cfg = self.config
        unknown = [tier for tier in bytes_per_tier if tier not in self.bandwidth]
        if self.prefill_s_per_token is None or unknown or tokens <= 0:
            return RatioChoice(cfg.floor, 0.0, self.recompute_seconds(tokens, cfg.floor), "unmeasured")
        load_s = sum(b / self.bandwidth[tier] for tier, b in bytes_per_tier.items())
        full_s = tokens * self.prefill_s_per_token
        fixed = cfg.full_layers / self.num_layers
        hidden = (load_s - full_s * fixed) / (full_s * (1 - fixed))
        if hidden <= cfg.floor:
            ratio, reason = cfg.floor, "floor"
        elif hidden >= cfg.ceiling:
            ratio, reason = cfg.ceiling, "ceiling"
        else:
            ratio, reason = hidden, "hidden"
        return RatioChoice(ratio, load_s, self.recompute_seconds(tokens, ratio), reason)
