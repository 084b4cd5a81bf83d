"""A transform-codec calibration from KV blocks alone: no model, no positions, no text.

`kvstore calibrate` runs the model over text, so it knows each key's position, the model's RoPE
frequencies and the queries' metric. A daemon that calibrates a namespace from the first blocks
it stores (`kvstore/daemon/autocal.py`) has only the blocks: keys after RoPE at positions nobody told it.
It recovers what it can from them, because what measured best (docs/compression.md) was coding
keys before RoPE and keeping the attention-sink positions raw, both of which need positions:

1. **RoPE frequencies.** Keys before RoPE have a large mean, so turning a block's keys back by
   their offset t within the block at the right frequencies makes them coherent: the energy of the
   block's mean over its tokens peaks. For the standard form f_j = theta^(-2j/D) (channel pairs
   (j, j + D/2), as `kernels/rope_ref.py` turns them) theta is fitted by that coherence on the
   first `WARMUP_BLOCKS` blocks: a log grid, then golden-section search. When no theta makes the
   blocks clearly more coherent than not turning them at all (`MIN_GAIN`: another RoPE form, or
   none), the calibration is post-RoPE (format v2), as good as plain PCA gets.
2. **Start positions.** A block's keys turned back by t alone still carry e^{i s f_j}, s its start.
   Against a mean taken in another block's frame, `transform.best_start` finds s relative to that
   block (negative allowed); the warm-up blocks' starts are taken relative to the longest, then
   shifted so the earliest is 0 (a namespace's first blocks include a prompt's first chunk: the
   engines store chunks in order). Every later block's start is found against the running mean,
   in [0, max_start) as the codec searches it.
3. **Sinks.** Positions 0..`SINK_TOKENS`-1 are stored raw by the codec, as with `kvstore calibrate`.

No query or o_proj metric (the daemon has no weights): plain PCA per row. Head groups are the
fewest that keep a row within `MAX_CHANNELS` channels (the [C, C] bases and the float64 statistics
grow as C^2); the daemon does not calibrate a layout where one head alone passes it
(`kvstore/daemon/autocal.py`). Scaled RoPE (Llama 3.1's long-context frequencies) is not the standard
form: a theta may still fit the first blocks, and later blocks' starts then go wrong; the daemon's
per-block check stores those blocks as they came, which costs size, not quality. Decoding never
depends on these estimates being right: a block records the start it was coded with, and a wrong
frequency or start only costs bytes or error, which the daemon checks per block.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from compression.calibration import Allocation, Calibration, turn_keys
from compression.calibration_fit import fit
from compression.calibration_stats import CalibrationStats
from compression.transform import MAX_START, best_start

WARMUP_BLOCKS = 4  # blocks held to fit theta and the first starts
SINK_TOKENS = 4
MAX_CHANNELS = 256
MIN_GAIN = 1.05  # fitted coherence / coherence unturned below this: no RoPE frame
THETA_RANGE = (1e2, 1e8)


def groups_for(num_kv_heads: int, head_dim: int, max_channels: int = MAX_CHANNELS) -> int:
    """Head groups per row: the fewest that keep a row within ``max_channels`` channels (at least one head)."""
    for groups in range(1, num_kv_heads + 1):
        if num_kv_heads % groups == 0 and num_kv_heads // groups * head_dim <= max_channels:
            return groups
    return num_kv_heads


def rope_freq(theta: float, head_dim: int) -> torch.Tensor:
    """[D/2] float32: the standard RoPE frequencies theta^(-2j/D)."""
    return (float(theta) ** (-torch.arange(head_dim // 2, dtype=torch.float64) * 2 / head_dim)).float()


def coherence(keys: list[torch.Tensor], freq: torch.Tensor | None) -> float:
    """Fraction of the keys' energy in each block's mean over its tokens once turned back by their
    offset t in the block at ``freq`` (None: not turned); keys: blocks [L, H, T, D]."""
    total = mean_energy = 0.0
    for k in keys:
        half = k.shape[-1] // 2
        z = torch.complex(k[..., :half].double(), k[..., half:].double())  # [L, H, T, J]
        if freq is not None:
            t = torch.arange(k.shape[2], dtype=torch.float64)[:, None]
            z = z * torch.polar(torch.ones(k.shape[2], half, dtype=torch.float64), -t * freq.double())
        mean_energy += float(z.mean(2).abs().pow(2).sum())
        total += float(z.abs().pow(2).mean(2).sum())
    return mean_energy / total if total > 0 else 0.0


def fit_theta(keys: list[torch.Tensor], max_layers: int = 8) -> tuple[float | None, float, float]:
    """``(theta or None, its coherence, coherence unturned)``: the standard-RoPE theta that makes
    the blocks' keys most coherent, None when none beats leaving them as they are by `MIN_GAIN`.
    Reads at most ``max_layers`` layers, evenly spaced (about 170 coherence evaluations)."""
    head_dim = keys[0].shape[-1]
    n_layers = keys[0].shape[0]
    if n_layers > max_layers:
        pick = torch.linspace(0, n_layers - 1, max_layers).round().long()
        keys = [k[pick] for k in keys]
    lo, hi = math.log(THETA_RANGE[0]), math.log(THETA_RANGE[1])
    grid = [lo + (hi - lo) * i / 120 for i in range(121)]
    scores = [coherence(keys, rope_freq(math.exp(x), head_dim)) for x in grid]
    best = max(range(len(grid)), key=scores.__getitem__)
    a, b = grid[max(0, best - 1)], grid[min(len(grid) - 1, best + 1)]
    golden = (math.sqrt(5) - 1) / 2
    c, d = b - golden * (b - a), a + golden * (b - a)
    fc, fd = (coherence(keys, rope_freq(math.exp(x), head_dim)) for x in (c, d))
    for _ in range(24):
        if fc > fd:
            b, d, fd = d, c, fc
            c = b - golden * (b - a)
            fc = coherence(keys, rope_freq(math.exp(c), head_dim))
        else:
            a, c, fc = c, d, fd
            d = a + golden * (b - a)
            fd = coherence(keys, rope_freq(math.exp(d), head_dim))
    theta, score = (math.exp(c), fc) if fc > fd else (math.exp(d), fd)
    if scores[best] > score:
        theta, score = math.exp(grid[best]), scores[best]
    unturned = coherence(keys, None)
    return (theta if score > MIN_GAIN * unturned else None), score, unturned


class BlindCalibration:
    """A calibration made from blocks of one namespace as they come (`add`), then `calibration`.

    Holds the first `WARMUP_BLOCKS` blocks' keys (float32) until the RoPE fit, then only the
    running statistics (`CalibrationStats`): rows * C^2 float64 numbers.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, warmup: int = WARMUP_BLOCKS,
                 max_channels: int = MAX_CHANNELS, max_start: int = MAX_START, layer_group: int = 1) -> None:
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.groups = groups_for(num_kv_heads, head_dim, max_channels)
        self.layer_group = layer_group  # layers per row (`Calibration.layer_group`)
        self.warmup = max(1, warmup)
        self.max_start = max_start
        self._held: list[torch.Tensor] = []  # warm-up blocks [L, 2, H, T, D] float32
        self.stats: CalibrationStats | None = None
        self.theta: float | None = None
        self.fit: tuple[float, float] = (0.0, 0.0)  # (coherence at theta, unturned)
        self.starts: list[int] = []  # the start found for each block added after the fit (for tests, logs)
        self.blocks = 0
        self._tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens of the blocks added (sink positions included)."""
        return self._tokens

    @property
    def short(self) -> bool:
        """Whether the statistics hold fewer tokens than `calibration` needs (sink positions are left
        out of them: many blocks at position 0 give fewer than `tokens` says)."""
        return self.stats is not None and self.stats.tokens < self.stats.needed_tokens

    def add(self, block: torch.Tensor) -> None:
        """Add a block [L, 2, H, T, D] (any float dtype, finite; not changed)."""
        if tuple(block.shape[i] for i in (0, 2, 4)) != self.shape or block.shape[1] != 2:
            raise ValueError(f"block {tuple(block.shape)} is not [{self.shape[0]}, 2, {self.shape[1]}, T, "
                             f"{self.shape[2]}]")
        self.blocks += 1
        self._tokens += block.shape[3]
        if self.stats is None:
            self._held.append(block.to(torch.float32, copy=True))
            if len(self._held) >= self.warmup:
                self._start_statistics()
            return
        self._add_found(block)

    def _start_statistics(self) -> None:
        held, self._held = self._held, []
        keys = [b[:, 0] for b in held]
        theta, *self.fit = fit_theta(keys)
        n_layers, n_heads, head_dim = self.shape
        if theta is None:
            self.stats = CalibrationStats(n_layers, n_heads, head_dim, self.groups, layer_group=self.layer_group)
            for block in held:
                self.stats.add(block)
            return
        self.theta = theta
        freq = rope_freq(theta, head_dim)
        self.stats = CalibrationStats(n_layers, n_heads, head_dim, self.groups, freq, SINK_TOKENS, self.layer_group)
        # starts relative to the longest warm-up block (its keys turned back by t: its frame), the
        # earliest taken as 0
        ref = max(range(len(held)), key=lambda i: held[i].shape[3])
        reference = turn_keys(held[ref][:, :1].clone(), 0, freq, to_rope=False, kernels_choice="torch")[:, 0].mean(2)
        relative = [0 if i == ref else best_start(b[:, 0], reference, freq, 2 * self.max_start, first=-self.max_start)
                    for i, b in enumerate(held)]
        base = min(relative)
        for block, start in zip(held, relative):
            self.starts.append(start - base)
            self.stats.add(block, start - base)

    def _add_found(self, block: torch.Tensor) -> None:
        stats = self.stats
        if stats.rope_inv_freq is None:
            stats.add(block)
            return
        # in the fixed frame, as the codec will search it: [0, max_start)
        start = best_start(block[:, 0], stats.key_mean(), stats.rope_inv_freq, self.max_start)
        self.starts.append(start)
        stats.add(block, start)

    def calibration(self, allocation: Allocation, source: str = "") -> Calibration:
        """The calibration of the blocks so far (the warm-up ones fitted first if fewer came)."""
        if self.stats is None:
            if not self._held:
                raise ValueError("no blocks to calibrate on")
            self._start_statistics()
        sinks = SINK_TOKENS if self.stats.rope_inv_freq is not None else 0
        rope = (f"RoPE theta {self.theta:.6g} fitted (coherence {self.fit[0]:.3f} against {self.fit[1]:.3f} unturned)"
                if self.theta is not None else
                f"post-RoPE (no RoPE theta fitted: coherence {self.fit[0]:.3f} against {self.fit[1]:.3f} unturned)")
        source = source or f"{self.blocks} blocks, {self.tokens} tokens, no model"
        return fit(self.stats, dataclasses.replace(allocation, sink_tokens=sinks), source=f"{source}; {rope}")
