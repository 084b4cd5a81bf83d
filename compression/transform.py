"""The calibrated transform codec (KVTC-style): project, quantize, entropy-code.

    codec = get_codec("kvtc@3fa9c2d1e0b4")    # a calibration id (prefix of >= 8 hex digits)
    encoded = codec.encode(block)             # params carry the full calibration id
    block2 = decode_block(encoded, shape, dtype)   # resolves the calibration by id

Per block [L, 2, H, T, D]: rows (layer, k/v, head group) of T token vectors [C] are centred and
projected on the calibration's PCA basis, each component quantized with its step (the bit
allocation; dropped components cost 0 bits), and the kept components' codes, one row per
component over the block's tokens, entropy-coded (`compression/entropy.py`)::

    x [B, T, C] --(x - mean) @ basis, / step, round--> codes [B, T, C] --kept--> [R, T] --rans--> bytes

Spec: ``kvtc[-rans|-zstd]@<calibration id>``: ``kvtc`` codes with kvstore's own interleaved rANS
(``ans``, native C), ``kvtc-rans`` with `constriction`'s range-ANS (the coder before; its blocks
still decode), ``kvtc-zstd`` with zstd.

RoPE-aware calibrations (``calibration.rope_inv_freq``, format v3) code keys before RoPE. The
codec needs the block's absolute start position s, which a block does not carry (a daemon
re-encoding a block for its disk tier sees only the tensor), so it estimates s from the keys
(`estimate_start`) and writes it into the params; decode rotates by the written s, so it is exact
whatever the estimate, and a wrong estimate only costs size and error within the stated bound::

    stored keys at s..s+T-1 --turn back to 0--> pre-RoPE keys --PCA, quantize--> codes   params: start = s
    codes --back-project--> pre-RoPE keys --turn to start..start+T-1--> decoded keys

Tokens at positions below ``allocation.sink_tokens`` (attention sinks, in the block at s = 0)
are stored raw in the block dtype, before the stream.

Error bound per token vector (basis orthonormal): the error is basis @ (y' - y), so every element
is at most its L2 norm, sqrt(sum over kept of (step/2)^2 + sum over dropped of y^2), plus float32
rounding of the two matmuls and the cast to the block dtype (`error_bound`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import kernels
from compression.base import (DTYPE_EPS, Codec, EncodedBlock, Section, check_block, check_layout, check_sections,
                              choice_param, int_param, param_dict, register_calibrated, split_sections, tensor_bytes)
from compression.calibration import Calibration, turn_keys
from compression.calibration_store import resolve
from compression.entropy import DEFAULT_CODER, ENTROPY_CODERS, decode_rows, encode_rows, stream_bound
from kernels import transform_ref

SPEC_PREFIX = "kvtc"
ID_DIGITS = 12  # calibration id digits in the canonical spec (the full id is in params)
MAX_START = 1 << 17  # start positions `estimate_start` considers when the calibration names no max_position
MAX_POSITION = 1 << 24  # the largest start a block may name (as a calibration's max_position: a context's length)


def estimate_start(keys: torch.Tensor, calibration: Calibration) -> int:
    """The start position s in [0, max_position) whose un-rotated keys best match the calibrated key mean.

    keys [L, H, T, D] as stored (after RoPE at s..s+T-1). In complex form a channel pair j,
    z = k[j] + i k[j + D/2], is turned by RoPE to z e^{i p f_j}. The score of s is the
    correlation of the keys turned back by s + t with the calibrated pre-RoPE mean mu::

        score(s) = Re sum_j A_j e^{-i s f_j},    A_j = sum_{l, h, t} conj(mu_ljh) z_lhtj e^{-i t f_j}

    a sum of D/2 sinusoids in s, evaluated at every candidate at once (float64 angles reduced mod 2 pi).
    """
    mean = calibration.rows_block(calibration.mean[:, None, :])[:, 0, :, 0]  # [L, H, D] (pre-RoPE)
    return best_start(keys, mean, calibration.rope_inv_freq, calibration.max_position or MAX_START)


def best_start(keys: torch.Tensor, mean: torch.Tensor, inv_freq: torch.Tensor, n_start: int, first: int = 0) -> int:
    """The s in [first, first + n_start) at which keys [L, H, T, D] (after RoPE at s..s+T-1) turned
    back to position 0 correlate best with ``mean`` [L, H, D] (keys before RoPE); see `estimate_start`.
    A negative ``first`` finds a start relative to a mean taken in another block's frame
    (`compression/blind.py`)."""
    n_layers, n_heads, n_tokens, head_dim = keys.shape
    half = head_dim // 2
    freq = inv_freq.double()  # [J]
    mean = mean.double()
    mu_re, mu_im = mean[..., :half].float(), mean[..., half:].float()  # [L, H, J]
    z_re, z_im = keys[..., :half].float(), keys[..., half:].float()  # [L, H, T, J]
    # w = sum over l, h of conj(mu) z, in real arithmetic: [T, J]
    w_re = torch.einsum("lhj,lhtj->tj", mu_re, z_re) + torch.einsum("lhj,lhtj->tj", mu_im, z_im)
    w_im = torch.einsum("lhj,lhtj->tj", mu_re, z_im) - torch.einsum("lhj,lhtj->tj", mu_im, z_re)
    t_phase = torch.polar(torch.ones(n_tokens, half, dtype=torch.float64),
                          -torch.arange(n_tokens, dtype=torch.float64)[:, None] * freq[None, :])  # [T, J]
    a = (torch.complex(w_re.double(), w_im.double()) * t_phase).sum(0)  # [J]
    if first:  # candidates first + s': e^{-i (first + s') f} = e^{-i first f} e^{-i s' f}
        a = a * torch.polar(torch.ones(half, dtype=torch.float64), torch.remainder(-first * freq, 2 * math.pi))
    # every s = u * n_fine + v at once: e^{-i s f} = e^{-i u n_fine f} e^{-i v f}, one [U, J] @ [J, V] product
    n_fine = 256
    n_coarse = -(-n_start // n_fine)
    coarse = torch.polar(torch.ones(n_coarse, half, dtype=torch.float64),
                         torch.remainder(-torch.arange(0, n_coarse * n_fine, n_fine, dtype=torch.float64)[:, None] * freq,
                                         2 * math.pi))
    fine = torch.polar(torch.ones(n_fine, half, dtype=torch.float64),
                       -torch.arange(n_fine, dtype=torch.float64)[:, None] * freq)  # [V, J]
    score = ((coarse * a[None, :]) @ fine.T).real.reshape(-1)[:n_start]  # [U, V] -> [S]: sum_j Re(A_j e^{-i s f_j})
    return first + int(torch.argmax(score))


class TransformCodec(Codec):
    """Calibrated PCA transform + uniform quantization + entropy coding; lossy (see `error_bound`)."""

    def __init__(self, calibration: str | Calibration, entropy: str = DEFAULT_CODER, kernels_choice: str | None = None):
        if entropy not in ENTROPY_CODERS:
            raise ValueError(f"entropy coder must be one of {ENTROPY_CODERS}, got {entropy!r}")
        self._calibration = calibration if isinstance(calibration, Calibration) else None
        self._calibration_ref = calibration.id if isinstance(calibration, Calibration) else calibration
        self.entropy = entropy
        self.kernels_choice = kernels_choice
        head = SPEC_PREFIX if entropy == DEFAULT_CODER else f"{SPEC_PREFIX}-{entropy}"
        self.name = f"{head}@{self._calibration_ref[:ID_DIGITS]}"

    @property
    def calibration(self) -> Calibration:
        if self._calibration is None:
            self._calibration = resolve(self._calibration_ref)
        return self._calibration

    def _frame(self, block: torch.Tensor, start: int | None = None) -> tuple[int, int, torch.Tensor]:
        """(start, raw tokens, rows [B, T - raw, C]) of the block in the calibration's key frame.

        Post-RoPE calibrations: start 0, no raw tokens, rows of the block as it is (its dtype).
        RoPE-aware ones: start estimated unless given, keys turned back to position 0 (float32),
        and the block's tokens at positions < sink_tokens cut off (they travel raw).
        """
        cal = self.calibration
        if cal.rope_inv_freq is None:
            return 0, 0, cal.block_rows(block)
        x = block.to(torch.float32, copy=True)  # turn_keys turns in place
        if start is None:
            start = estimate_start(x[:, 0], cal)
        if not (type(start) is int and 0 <= start <= MAX_POSITION):
            raise ValueError(f"kvtc: start is {start!r:.40}; must be an integer in 0..{MAX_POSITION}")
        n_raw = sink_count(cal, start, block.shape[3])
        x = turn_keys(x, start, cal.rope_inv_freq, to_rope=False, kernels_choice=self.kernels_choice)
        return start, n_raw, cal.block_rows(x[:, :, :, n_raw:])

    def encode(self, block: torch.Tensor, start: int | None = None) -> EncodedBlock:
        """``start``: the block's first position if the caller knows it (else estimated, RoPE-aware only)."""
        check_block(block)
        cal = self.calibration
        if (block.shape[0], block.shape[2], block.shape[4]) != (cal.num_layers, cal.num_kv_heads, cal.head_dim):
            # said here, before any tensor op would fail on it in its own words
            raise ValueError(f"shape {tuple(block.shape)} does not match calibration {cal.id[:12]} "
                             f"[{cal.num_layers}, 2, {cal.num_kv_heads}, T, {cal.head_dim}]: a block of another "
                             f"layout cannot be coded with it")
        start, n_raw, rows = self._frame(block, start)  # rows [B, T', C]
        sections, parts = [], []
        if n_raw:
            raw = tensor_bytes(block[:, :, :, :n_raw])  # [L, 2, H, n_raw, D] in the block dtype
            sections.append(["sinks", len(raw), block.element_size()])
            parts.append(raw)
        if rows.shape[1]:
            device = rows.device
            if kernels.backend(rows, self.kernels_choice) == "torch":  # onto the kept components only
                kept = transform_ref.project_quantize_kept(rows, cal.mean.to(device), cal.kept_analysis.to(device),
                                                           cal.kept_counts.to(device), cal.kept_inv_step.to(device))
            else:
                op = kernels.transform_ops(rows, self.kernels_choice)
                codes = op.project_quantize(rows, cal.mean.to(device), cal.analysis.to(device),
                                            cal.inv_step.to(device))
                kept = codes.transpose(1, 2)[cal.kept.to(device)]  # [R, T']: one row per kept component
            stream = encode_rows(kept.cpu().numpy(), self.entropy)
            sections.append(["stream", len(stream), 1])
            parts.append(stream)
        params = {"calibration": cal.id, "entropy": self.entropy, "sections": sections}
        if cal.rope_inv_freq is not None:
            params.update(start=start, sink_tokens=n_raw)
        return EncodedBlock(b"".join(parts), params, self.name)

    def check_params(self, params, shape, dtype) -> list[Section]:
        return self._checked(params, shape, dtype)[0]

    def _checked(self, params, shape, dtype) -> tuple[list[Section], Calibration, int, int]:
        """(sections, calibration, start, sink tokens) of a block's params, checked against its layout:
        ``calibration`` a full id whose layout is the block's, ``entropy`` a known coder, ``start`` in
        0..`MAX_POSITION` iff the calibration is RoPE-aware, ``sink_tokens`` what the calibration's sink
        positions leave raw from that start (0..tokens), the sinks' exact bytes and a stream of at
        most `stream_bound` of the kept codes."""
        check_layout(shape, dtype)
        params = param_dict(params, SPEC_PREFIX)
        wanted = params.get("calibration")
        if not (type(wanted) is str and len(wanted) == 64 and all(c in "0123456789abcdef" for c in wanted)):
            # a block names the full id (a prefix could match another's calibration)
            raise ValueError(f"kvtc: calibration is {wanted!r:.80}; must be a 64-digit lower-case hex id")
        choice_param(params, "entropy", SPEC_PREFIX, ENTROPY_CODERS)
        n_tokens = shape[3]
        start = int_param(params, "start", SPEC_PREFIX, 0, MAX_POSITION, "a context's length at most", default=0)
        n_raw = int_param(params, "sink_tokens", SPEC_PREFIX, 0, n_tokens, "the block's tokens", default=0)
        own = self._calibration
        cal = own if own is not None and own.id == wanted else resolve(wanted)
        if (shape[0], shape[2], shape[4]) != (cal.num_layers, cal.num_kv_heads, cal.head_dim):
            raise ValueError(f"shape {tuple(shape)} does not match calibration {cal.id[:12]} "
                             f"[{cal.num_layers}, 2, {cal.num_kv_heads}, T, {cal.head_dim}]")
        rope = cal.rope_inv_freq is not None
        if rope != ("start" in params):
            raise ValueError(f"block params {'lack' if rope else 'have'} a start position but calibration "
                             f"{cal.id[:12]} is {'RoPE-aware' if rope else 'post-RoPE'}: damaged header?")
        if n_raw != sink_count(cal, start, n_tokens):
            raise ValueError(f"kvtc: sink_tokens is {n_raw}; must be {sink_count(cal, start, n_tokens)} (the "
                             f"calibration's {cal.allocation.sink_tokens} sink positions from start {start})")
        itemsize = dtype.itemsize
        expected = [("sinks", shape[0] * 2 * shape[2] * n_raw * shape[4] * itemsize, itemsize)] if n_raw else []
        if n_tokens > n_raw:
            expected.append(("stream", None, 1))
        limit = stream_bound(int(cal.kept_counts.sum()), n_tokens - n_raw)
        return check_sections(params, SPEC_PREFIX, expected, limit), cal, start, n_raw

    def decode(self, payload, params, shape, dtype, device="cpu") -> torch.Tensor:
        sections, cal, start, n_raw = self._checked(params, shape, dtype)
        rope = cal.rope_inv_freq is not None
        n_tokens = shape[3]
        views = split_sections(payload, sections)
        coded = n_tokens - n_raw
        if coded:
            kept_mask = cal.kept  # [B, C]
            stream = bytes(views["stream"].numpy())
            kept = decode_rows(stream, int(kept_mask.sum()), coded, params["entropy"])  # [R, T']
            kept = torch.from_numpy(kept).to(device)
            out_dtype = torch.float32 if rope else dtype
            if kernels.backend(kept, self.kernels_choice) == "torch":
                # over the kept components only: 20-40% fewer products at the measured settings
                rows = transform_ref.dequantize_backproject_kept(kept, cal.kept_counts.to(device),
                                                                 cal.kept_synthesis.to(device), cal.mean.to(device),
                                                                 out_dtype)
            else:
                codes = torch.zeros(cal.rows, cal.channels, coded, dtype=torch.int32, device=device)  # [B, C, T']
                codes[kept_mask.to(device)] = kept
                codes = codes.transpose(1, 2)  # [B, T', C] (a view)
                op = kernels.transform_ops(codes, self.kernels_choice)
                rows = op.dequantize_backproject(codes, cal.step.to(device), cal.synthesis.to(device),
                                                 cal.mean.to(device), out_dtype)
            body = cal.rows_block(rows)  # [L, 2, H, T', D]
            if not rope:
                return body
            body = turn_keys(body.contiguous(), start + n_raw, cal.rope_inv_freq, to_rope=True,
                             kernels_choice=self.kernels_choice).to(dtype)
        if not n_raw:
            return body
        sinks = views["sinks"].view(dtype).view(shape[0], 2, shape[2], n_raw, shape[4]).to(device)
        return torch.cat((sinks, body), dim=3) if coded else sinks.clone()

    def error_bound(self, block: torch.Tensor, start: int | None = None) -> float:
        cal = self.calibration
        _, _, rows = self._frame(block, start)
        rows = rows.float()  # [B, T', C]
        if rows.shape[1] == 0:
            return 0.0  # every token raw
        y = torch.bmm(rows - cal.mean[:, None, :], cal.analysis)  # [B, T, C]
        half = (cal.step / 2)[:, None, :].expand_as(y)  # [B, T, C]
        clipped = y.abs() * cal.inv_step[:, None, :] > transform_ref.CODE_MAX
        per = torch.where(cal.kept[:, None, :] & ~clipped, half, y.abs())  # |y' - y| per component, at most
        # |x' - x|_c = |sum_k (y' - y)_k synthesis[k, c]| <= |y' - y|_2 * |synthesis[:, c]|_2 (Cauchy-Schwarz)
        gain = cal.synthesis.pow(2).sum(1).sqrt().amax(-1)  # [B]
        if cal.rope_inv_freq is not None:  # a RoPE turn mixes channels c and c + D/2 of a key: |e| <= |(e_c, e_c')|_2
            gain = torch.where(cal.is_key_row, gain * math.sqrt(2), gain)
        err = per.pow(2).sum(-1).sqrt() * gain[:, None]  # [B, T]
        # float32 matmuls: ~C ulps of the largest partial sums, on the way in and out
        y_amax = y.abs().amax(-1)  # [B, T]
        x_amax = rows.abs().amax(-1)  # [B, T]
        fp32 = 4 * cal.channels * 2.0**-24 * (x_amax + cal.mean.abs().amax(-1)[:, None] + y_amax * gain[:, None]
                                              + y_amax * cal.analysis.abs().amax((1, 2))[:, None])
        if cal.rope_inv_freq is not None:  # the two float32 turns (encode, decode): a few ulps each
            fp32 = fp32 + 8 * 2.0**-24 * (x_amax + err)
        if cal.rope_inv_freq is not None:
            x_amax = x_amax * math.sqrt(2)  # the decoded keys' magnitude after the turn, at most
        bound = err * (1 + 1e-5) + fp32 + (x_amax + err) * DTYPE_EPS[block.dtype]
        return float(bound.max())


def sink_count(calibration: Calibration, start: int, n_tokens: int) -> int:
    """Tokens of a block at positions start..start+T-1 that the calibration's sink positions keep raw."""
    return max(0, min(n_tokens, calibration.allocation.sink_tokens - start))


def parse_spec(head: str) -> TransformCodec:
    """``kvtc@<id>`` or ``kvtc-<coder>@<id>`` -> the codec; ValueError with the expected form."""
    name, at, ref = head.partition("@")
    coder = name[len(SPEC_PREFIX) + 1:] if name.startswith(SPEC_PREFIX + "-") else DEFAULT_CODER
    if not at or not ref or name not in (SPEC_PREFIX, f"{SPEC_PREFIX}-{coder}") or coder not in ENTROPY_CODERS:
        raise ValueError(f"transform codec spec is kvtc@<calibration id>, kvtc-rans@<id> or kvtc-zstd@<id>, got {head!r}")
    if not all(c in "0123456789abcdef" for c in ref) or len(ref) < 8:
        raise ValueError(f"calibration id in {head!r} must be >= 8 lower-case hex digits (see `kvstore calibrate`)")
    return TransformCodec(ref, coder)


def stats(codec: TransformCodec, block: torch.Tensor) -> dict[str, Any]:
    """Kept components and bits per kept code of one block, for benchmarks."""
    cal = codec.calibration
    encoded = codec.encode(block)
    n_codes = int(cal.kept.sum()) * block.shape[3]
    return {"kept_components": int(cal.kept.sum()), "of": cal.rows * cal.channels,
            "bits_per_code": 8 * encoded.nbytes / n_codes if n_codes else math.nan,
            "bits_per_value": 8 * encoded.nbytes / block.numel()}


register_calibrated(SPEC_PREFIX, parse_spec)
