"""Fitting a calibration to statistics: per row a PCA basis in the metric's space, and its steps.

    stats = CalibrationStats(L, H, D, rope_inv_freq=inv_freq, sink_tokens=4)   # calibration_stats.py
    for block in blocks: stats.add(block)
    calibration = fit(stats, Allocation(0.3, 0.6, sink_tokens=4), metric=model_stats.metric(1, pre_rope=True))
    calibration = calibrate(blocks, allocation, ...)                             # the two steps at once

Metric: errors are measured where they act, not in raw KV units. A key error d moves attention
logits by q . d, so keys are coded in a space whitened by the queries' second moment
(E[q q^T] over the query heads that share the KV head); a value error reaches the residual
stream through o_proj, so values are weighted by W_o^T W_o of those heads. With a metric M
(symmetric PSD) and W = M^(1/2), rows are whitened (x W), PCA'd there (basis V), and::

    analysis = W V   [C, C]      synthesis = V^T W^-1   [C, C]      (M = I: analysis = V, synthesis = V^T)

Steps: `calibration.allocation_steps` per row (see `compression/calibration.py`, "Bit allocation");
with layer groups each layer's own step is folded into the basis (`_fit_grouped`).
"""

from __future__ import annotations

import torch

from compression.calibration import Allocation, Calibration, allocation_steps, row_rms
from compression.calibration_stats import CalibrationStats


def fit(stats: CalibrationStats, allocation: Allocation, metric: torch.Tensor | None = None, source: str = "",
        max_position: int = 0) -> Calibration:
    """The calibration of what ``stats`` holds (see `calibrate` for ``metric`` and ``max_position``)."""
    probe = stats.layout
    n_layers, n_heads, head_dim, groups = probe.num_layers, probe.num_kv_heads, probe.head_dim, probe.groups
    n_rows, n_chan = probe.rows, probe.channels
    if allocation.sink_tokens != stats.sink_tokens:
        raise ValueError(f"allocation.sink_tokens ({allocation.sink_tokens}) is not the {stats.sink_tokens} "
                         f"the statistics left out")
    if stats.tokens < stats.needed_tokens:
        grouped = f" ({probe.layer_group} layers each)" if probe.layer_group > 1 else ""
        raise ValueError(f"calibrate needs at least {stats.needed_tokens} tokens for {n_chan}-channel rows"
                         f"{grouped}, got {stats.tokens}; give it more text"
                         + (" or group fewer layers" if grouped else ""))
    if probe.layer_group > 1:
        return _fit_grouped(stats, allocation, metric, source, max_position)
    mean = stats.total / stats.tokens  # [B, C]
    cov = stats.outer / stats.tokens - mean[:, :, None] * mean[:, None, :]  # [B, C, C]
    if metric is None:
        whiten = unwhiten = torch.eye(n_chan, dtype=torch.float64).expand(n_rows, n_chan, n_chan)
    else:
        if tuple(metric.shape) != (n_rows, n_chan, n_chan):
            raise ValueError(f"metric must be [{n_rows}, {n_chan}, {n_chan}], got {tuple(metric.shape)}")
        m_val, m_vec = torch.linalg.eigh(metric.double())  # M = U diag(m) U^T
        m_val = m_val.clamp_min(m_val.amax(-1, keepdim=True) * 1e-6)  # keep W invertible
        whiten = m_vec @ torch.diag_embed(m_val.sqrt()) @ m_vec.transpose(1, 2)  # W = M^(1/2)
        unwhiten = m_vec @ torch.diag_embed(m_val.rsqrt()) @ m_vec.transpose(1, 2)  # W^-1
    cov = whiten.transpose(1, 2) @ cov @ whiten  # covariance of x W
    eigval, eigvec = torch.linalg.eigh(cov)  # ascending
    eigval, eigvec = eigval.flip(-1).clamp_min(0), eigvec.flip(-1)  # by falling variance
    std = eigval.sqrt().float()
    analysis = (whiten @ eigvec).float().contiguous()  # [B, C, C]
    synthesis = (eigvec.transpose(1, 2) @ unwhiten).float().contiguous()  # [B, C, C]
    step = allocation_steps(std, row_rms(std), allocation, groups)
    return Calibration(n_layers, n_heads, head_dim, groups, mean.float(), analysis, synthesis, std, step,
                       allocation, source, stats.rope_inv_freq, max_position)


def _fit_grouped(stats: CalibrationStats, allocation: Allocation, metric: torch.Tensor | None, source: str,
                 max_position: int) -> Calibration:
    """`fit` (its checks passed) with rows over ``layer_group`` layers: each layer's channels whitened by its own
    metric and divided by the step a per-layer row would get (``rel_step * rms(layer) * row_scale``),
    then one PCA per row; every kept component has step 1 in those units."""
    probe = stats.layout
    lg, groups = probe.layer_group, probe.groups
    n_rows, n_chan, n_layer_rows = probe.rows, probe.channels, probe.layer_rows
    sub = n_chan // lg  # one layer's channels in a row
    if allocation.row_scale and len(allocation.row_scale) != n_layer_rows:
        raise ValueError(f"allocation.row_scale has {len(allocation.row_scale)} factors for {n_layer_rows} rows")
    if metric is not None and tuple(metric.shape) != (n_layer_rows, sub, sub):
        raise ValueError(f"metric must be [{n_layer_rows}, {sub}, {sub}] (per layer row), got {tuple(metric.shape)}")
    mean = stats.total / stats.tokens  # [B, C]
    analysis = torch.empty(n_rows, n_chan, n_chan)
    synthesis = torch.empty(n_rows, n_chan, n_chan)
    std = torch.empty(n_rows, n_chan)
    for b in range(n_rows):  # a row at a time: float64 [C, C] temporaries for one row only
        first, kv, g = b // (2 * groups) * lg, b // groups % 2, b % groups
        rel = allocation.key_step if kv == 0 else allocation.value_step
        cov = stats.outer[b] / stats.tokens - mean[b, :, None] * mean[b, None, :]  # [C, C]
        whiten = torch.zeros(n_chan, n_chan, dtype=torch.float64)
        unwhiten = torch.zeros_like(whiten)
        for j in range(lg):
            layer_row = ((first + j) * 2 + kv) * groups + g  # row b of a per-layer calibration
            part = slice(j * sub, (j + 1) * sub)
            if metric is None:
                w = w_inv = torch.eye(sub, dtype=torch.float64)
            else:
                m_val, m_vec = torch.linalg.eigh(metric[layer_row].double())
                m_val = m_val.clamp_min(m_val.amax() * 1e-6)
                w = m_vec @ torch.diag(m_val.sqrt()) @ m_vec.T
                w_inv = m_vec @ torch.diag(m_val.rsqrt()) @ m_vec.T
            rms = float((w.T @ cov[part, part] @ w).diagonal().mean().clamp_min(0).sqrt())
            step = rel * (allocation.row_scale[layer_row] if allocation.row_scale else 1.0) * rms
            if not step > 1e-30:  # a layer without spread gets no components (its blocks stay 0): its
                continue  # channels decode to their mean, as a per-layer row's would with step 0
            whiten[part, part] = w / step
            unwhiten[part, part] = w_inv * step
        eigval, eigvec = torch.linalg.eigh(whiten.T @ cov @ whiten)  # in units of each layer's step
        eigval, eigvec = eigval.flip(-1).clamp_min(0), eigvec.flip(-1)
        std[b] = eigval.sqrt().float()
        analysis[b] = (whiten @ eigvec).float()
        synthesis[b] = (eigvec.T @ unwhiten).float()
    step = (std >= allocation.drop).float()  # step 1 (in the whitened, step-scaled units) or dropped
    return Calibration(probe.num_layers, probe.num_kv_heads, probe.head_dim, groups, mean.float(), analysis,
                       synthesis, std, step, allocation, source, stats.rope_inv_freq, max_position, lg)


def calibrate(blocks: list[torch.Tensor], allocation: Allocation, groups: int = 1,
              metric: torch.Tensor | None = None, source: str = "",
              rope_inv_freq: torch.Tensor | None = None, max_position: int = 0, layer_group: int = 1) -> Calibration:
    """A calibration from KV blocks [L, 2, H, T_i, D] of one namespace (any token counts).

    Per row: mean and covariance over all tokens of all blocks (float64); with ``metric``
    [B, C, C] (symmetric PSD per row, e.g. `engine_adapter.calibrate.ModelStats.metric`) the
    covariance is taken in the whitened space; eigenvectors by falling eigenvalue are the basis,
    sqrt(eigenvalue) the component std; steps from `allocation`.

    With ``rope_inv_freq`` [D/2] the blocks must each start at position 0 (a prefill of one text):
    their keys are turned back to position 0 first and the first ``allocation.sink_tokens`` tokens
    of each are left out; the key metric must then be in that frame too (`ModelStats.metric`).
    ``max_position`` (the model's context length) bounds the start positions the codec considers.
    ``layer_group``: layers per row (see `compression/calibration.py`, "Layer groups"); ``metric``
    stays per layer row.
    """
    if not blocks:
        raise ValueError("calibrate needs at least one KV block")
    n_layers, _, n_heads, _, head_dim = blocks[0].shape
    stats = CalibrationStats(n_layers, n_heads, head_dim, groups, rope_inv_freq, allocation.sink_tokens, layer_group)
    for block in blocks:
        stats.add(block)
    return fit(stats, allocation, metric, source, max_position)
