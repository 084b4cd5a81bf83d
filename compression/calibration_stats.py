"""The statistics a calibration is fitted from: running per-row sums of one namespace's KV blocks.

`CalibrationStats` keeps, per row (layer, k/v, head group; `compression/calibration.py`), the sum
of the row's vectors [B, C] and of their outer products [B, C, C] in float64, so a caller that sees
blocks one at a time (the daemon calibrating a namespace from its first blocks,
`compression/blind.py` for `kvstore/daemon/autocal.py`) holds B * C * C numbers, not the blocks.
`compression/calibration_fit.py` makes a `Calibration` from them.
"""

from __future__ import annotations

import torch

from compression.calibration import Allocation, Calibration, check_layer_group, turn_keys


class CalibrationStats:
    """Running per-row sums of KV blocks of one namespace, from which `calibration_fit.fit` makes a
    Calibration. With ``rope_inv_freq`` each block's keys are turned back to position 0 from the
    start `add` is given (see `calibration_fit.calibrate`).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, groups: int = 1,
                 rope_inv_freq: torch.Tensor | None = None, sink_tokens: int = 0, layer_group: int = 1) -> None:
        if num_kv_heads % groups:
            raise ValueError(f"groups ({groups}) must divide num_kv_heads ({num_kv_heads})")
        check_layer_group(layer_group, num_layers, num_kv_heads // groups * head_dim)
        n_chan = layer_group * num_kv_heads // groups * head_dim
        n_rows = num_layers // layer_group * 2 * groups
        eye = torch.eye(n_chan).expand(n_rows, n_chan, n_chan)
        zeros = torch.zeros(n_rows, n_chan)
        # the layout's rows (block_rows) without a basis yet
        self._probe = Calibration(num_layers, num_kv_heads, head_dim, groups, zeros, eye, eye, zeros, zeros,
                                  Allocation(1.0, 1.0, sink_tokens=sink_tokens), rope_inv_freq=rope_inv_freq,
                                  layer_group=layer_group)
        self.rope_inv_freq = rope_inv_freq
        self.sink_tokens = sink_tokens
        self.total = torch.zeros(n_rows, n_chan, dtype=torch.float64)
        self.outer = torch.zeros(n_rows, n_chan, n_chan, dtype=torch.float64)
        self.tokens = 0

    def add(self, block: torch.Tensor, start: int = 0) -> None:
        """Add a block [L, 2, H, T, D] (any dtype; not changed) whose keys are at positions start..start+T-1."""
        if self.rope_inv_freq is not None:
            # a copy: turn_keys turns in place, and a float32 block would otherwise be the caller's
            block = turn_keys(block.to(torch.float32, copy=True), start, self.rope_inv_freq, to_rope=False,
                              kernels_choice="torch")
            block = block[:, :, :, max(0, self.sink_tokens - start):]  # sinks are stored raw, never projected
        x = self._probe.block_rows(block).double()  # [B, T, C]
        self.total += x.sum(dim=1)
        self.outer += torch.bmm(x.transpose(1, 2), x)  # [B, C, T] @ [B, T, C] -> [B, C, C]
        self.tokens += x.shape[1]

    @property
    def needed_tokens(self) -> int:
        """Tokens (sink positions left out) `calibration_fit.fit` needs: twice a row's channels."""
        return 2 * self._probe.channels

    def key_mean(self) -> torch.Tensor:
        """[L, H, D] float32: the mean key so far (before RoPE with ``rope_inv_freq``)."""
        mean = (self.total / max(1, self.tokens)).float()
        return self._probe.rows_block(mean[:, None, :])[:, 0, :, 0]

    @property
    def layout(self) -> Calibration:
        """The rows' layout (sizes, groups, `block_rows`): a Calibration with identity bases, no steps."""
        return self._probe
