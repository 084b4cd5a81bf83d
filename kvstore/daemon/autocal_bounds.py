"""kvtc@auto's bounds: which layouts the daemon calibrates, how, and what a coded block may lose.

A calibration's rows are one layer's K or V channels (heads grouped by `groups_for`), or
``layer_group`` consecutive layers' (`layer_group_for` fits the asked number to a layout's bounds);
a layout whose rows or calibration would be too large is never calibrated (`unfit_layout`).

Every coded block is decoded again and compared, per layer and K/V, against the block's own spread
(RMS of each token vector about the block's mean; `code_checked`): the whole block's error above
`MAX_RELATIVE_ERROR`, or any one token vector's above `MAX_TOKEN_ERROR`, and the block is stored as
it is, counted (honest calibrations measure 0.10-0.13 and 0.12-0.14 on real blocks; a calibration
made from unrepresentative or hostile first blocks, or a drifting workload, costs size). The
scheduling around them (sampling, slots, publishing) is ``kvstore/daemon/autocal.py``'s.
"""

from __future__ import annotations

import torch

from compression.base import EncodedBlock
from compression.blind import MAX_CHANNELS, groups_for
from compression.calibration import MAX_GROUP_CHANNELS, Calibration
from kvstore.keys import KVLayout

DEFAULT_SAMPLE_TOKENS = 8192
MAX_RELATIVE_ERROR = 0.25  # a layer's K or V over the block: |x' - x| / |x - mean over tokens|
MAX_TOKEN_ERROR = 0.5  # one token vector's error / the RMS spread of that layer's K or V in the block
MAX_CALIBRATION_BYTES = 160 << 20  # a calibration this large is fetched inline by engines (max_message_bytes)


def layer_channels(layout: KVLayout) -> int:
    """Channels of one layer's row in the daemon's calibrations (its heads grouped by `groups_for`)."""
    return layout.num_kv_heads // groups_for(layout.num_kv_heads, layout.head_dim) * layout.head_dim


def calibration_bytes(layout: KVLayout, layer_group: int = 1) -> int:
    """About the bytes of a calibration of this layout (two [rows, C, C] float32 matrices; rows of
    ``layer_group`` layers are that many times a per-layer one's)."""
    channels = layer_channels(layout)
    groups = layout.num_kv_heads * layout.head_dim // channels
    return 2 * layout.num_layers * 2 * groups * channels * channels * 4 * layer_group


def layer_group_for(layout: KVLayout, wanted: int, limit: int = MAX_CALIBRATION_BYTES,
                    sample_tokens: int = DEFAULT_SAMPLE_TOKENS) -> int:
    """Layers per row for this layout: the largest divisor of its layers up to ``wanted`` whose rows
    stay within `MAX_GROUP_CHANNELS` channels, whose calibration stays within ``limit`` and whose
    rows' statistics a sample of ``sample_tokens`` can give (twice the channels at least); else 1."""
    channels = layer_channels(layout)
    for layer_group in range(min(wanted, layout.num_layers), 1, -1):
        width = layer_group * channels
        if layout.num_layers % layer_group == 0 and width <= MAX_GROUP_CHANNELS and 2 * width <= sample_tokens \
                and calibration_bytes(layout, layer_group) <= limit:
            return layer_group
    return 1


def unfit_layout(layout: KVLayout, limit: int = MAX_CALIBRATION_BYTES) -> str:
    """Why a layout is never calibrated automatically ("" if it can be)."""
    channels = layer_channels(layout)
    if layout.head_dim % 2:
        return f"head_dim {layout.head_dim} is odd"
    if channels > MAX_CHANNELS:
        return f"rows of {channels} channels (heads of {layout.head_dim}) pass {MAX_CHANNELS}"
    if calibration_bytes(layout) > limit:
        return f"its calibration would take {calibration_bytes(layout) >> 20} MiB (at most {limit >> 20})"
    return ""


def relative_errors(block: torch.Tensor, decoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per layer and K/V [L, 2], per token vector [L, 2, T])`` errors of ``decoded``, relative to the
    spread of ``block``: |x' - x| over |x - mean over tokens| (the whole block's, or its RMS per token)."""
    x = block.double()
    err = (decoded.double() - x).pow(2).sum((2, 4))  # [L, 2, T]: squared error per token (over heads, dims)
    spread = (x - x.mean(3, keepdim=True)).pow(2).sum((2, 4))  # [L, 2, T]
    total = (err.sum(2) / spread.sum(2).clamp_min(1e-300)).sqrt()
    per_token = (err / spread.mean(2, keepdim=True).clamp_min(1e-300)).sqrt()
    return total, per_token


def code_checked(calibration: Calibration, block: torch.Tensor) -> EncodedBlock | None:
    """``block`` [L, 2, H, T, D] coded with ``calibration`` (kvtc), decoded again and compared with
    it: the encoding, or None when any layer's K or V errs past `MAX_RELATIVE_ERROR` of the block's
    spread, or any token vector past `MAX_TOKEN_ERROR` (a NaN error too). Raises what the codec
    raises (e.g. on a non-finite block)."""
    from compression.transform import TransformCodec

    codec = TransformCodec(calibration)
    encoded = codec.encode(block)
    decoded = codec.decode(encoded.payload, encoded.params, tuple(block.shape), block.dtype)
    total, per_token = relative_errors(block, decoded)
    if not (float(total.max()) <= MAX_RELATIVE_ERROR and float(per_token.max()) <= MAX_TOKEN_ERROR):  # NaN too
        return None
    return encoded
