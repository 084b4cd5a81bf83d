"""The codecs: raw, int8, int4/int2 (KIVI grouping), and the lossless stages shuffle, lz4, zstd.

Quantizer payloads are a concatenation of sections listed in ``params["sections"]`` as
``[name, byte length, item size]``; lossless stages use the item sizes (see `ShuffleStage`).
Formulations, bit layouts and measured sizes: docs/notes/compression-log.md.

Measured on real SmolLM2-135M KV (fp16, 256 tokens; bench/codecs.py): lz4 gains nothing on any
payload (1.00x); zstd level 1 gains 1.08x on raw fp16, and 1.16x after a byte-plane shuffle;
level 3 adds under 0.02x at a third of the speed; a token-delta before the shuffle loses
(1.13-1.14x). So the recommended lossless stage is ``shuffle+zstd`` (`DEFAULT_LOSSLESS`).
"""

from __future__ import annotations

import math

import lz4.block
import numpy as np
import torch
import zstandard

import kernels
from compression.base import (
    DTYPE_EPS,
    Codec,
    EncodedBlock,
    LosslessStage,
    Section,
    check_block,
    check_layout,
    check_sections,
    choice_param,
    int_param,
    param_dict,
    register_quantizer,
    register_stage,
    split_sections,
    stage_size,
    tensor_bytes,
)
from kernels import quant_ref

DEFAULT_GROUP_SIZE = 32
DEFAULT_LOSSLESS = "shuffle+zstd"
META_DTYPES = {"float16": torch.float16, "float32": torch.float32}
FP16_META_LIMIT = 2.0**15  # blocks with |x| beyond this keep their scale/zero in float32
# relative rounding of a stored scale or zero (half an ulp at 1.0)
META_ROUNDING = {torch.float16: 2.0**-11, torch.float32: 2.0**-24}
META_ABS_FLOOR = 2.0**-24  # float16 subnormal spacing: rounding of tiny zeros and scales


# ---------------------------------------------------------------------------------------------
# quantizers
# ---------------------------------------------------------------------------------------------


class RawCodec(Codec):
    """The block's own bytes (C order, its dtype). Lossless."""

    name = "raw"
    lossless = True

    def encode(self, block: torch.Tensor) -> EncodedBlock:
        check_block(block)
        payload = tensor_bytes(block)
        return EncodedBlock(payload, {"sections": [["block", len(payload), block.element_size()]]}, self.name)

    def check_params(self, params, shape, dtype) -> list[Section]:
        """One section, the block itself; ``sections`` may be absent (a raw Put carries no params)."""
        check_layout(shape, dtype)
        itemsize = dtype.itemsize
        expected = [("block", math.prod(shape) * itemsize, itemsize)]
        return check_sections(params, self.name, expected) if "sections" in param_dict(params, self.name) else expected

    def decode(self, payload, params, shape, dtype, device="cpu") -> torch.Tensor:
        block = split_sections(payload, self.check_params(params, shape, dtype))["block"]
        return block.view(dtype).view(shape).to(device)

    def error_bound(self, block: torch.Tensor) -> float:
        return 0.0


class Int8Codec(Codec):
    """Symmetric int8, one float32 scale per (layer, k/v, head, token) row of head_dim.

    Error bound per row: scale * (1/2 + 2**-14) + amax_row * eps(dtype), where scale = amax/127;
    the last term covers the cast of the decoded value back to the block dtype.
    """

    name = "int8"

    def __init__(self, kernels_choice: str | None = None):
        self.kernels_choice = kernels_choice

    def encode(self, block: torch.Tensor) -> EncodedBlock:
        check_block(block)
        rows = block.reshape(-1, block.shape[-1])  # [L*2*H*T, D]
        q, scale = kernels.ops(rows, self.kernels_choice).quantize_int8(rows)
        q_bytes, s_bytes = tensor_bytes(q), tensor_bytes(scale)
        sections = [["q", len(q_bytes), 1], ["scale", len(s_bytes), 4]]
        return EncodedBlock(q_bytes + s_bytes, {"sections": sections}, self.name)

    def check_params(self, params, shape, dtype) -> list[Section]:
        """int8 values of every row, then a float32 scale per row."""
        check_layout(shape, dtype)
        n_rows = math.prod(shape[:-1])
        expected = [("q", n_rows * shape[-1], 1), ("scale", n_rows * 4, 4)]
        return check_sections(param_dict(params, self.name), self.name, expected)

    def decode(self, payload, params, shape, dtype, device="cpu") -> torch.Tensor:
        n_rows = math.prod(shape[:-1])
        parts = split_sections(payload, self.check_params(params, shape, dtype))
        q = parts["q"].view(torch.int8).view(n_rows, shape[-1]).to(device)  # [R, D]
        scale = parts["scale"].view(torch.float32).to(device)  # [R]
        return kernels.ops(q, self.kernels_choice).dequantize_int8(q, scale, dtype).view(shape)

    def error_bound(self, block: torch.Tensor) -> float:
        rows = block.reshape(-1, block.shape[-1]).float()  # [R, D]
        _, scale = quant_ref.quantize_int8(rows)
        bound = scale * (0.5 + 2.0**-14) + rows.abs().amax(dim=1) * DTYPE_EPS[block.dtype]
        return float(bound.max())


class LowbitCodec(Codec):
    """KIVI-style asymmetric int4/int2: keys per channel, values per token, bit-packed.

    Keys [L, H, T, D] are viewed as rows (l, h, channel) of T tokens, grouped along tokens;
    values [L, H, T, D] as rows (l, h, token) of D channels, grouped along channels. Each group of
    `group_size` stores a scale and a zero (float16, or float32 when |x| >= 2**15) and codes
    q = round((x - zero) / scale) in [0, 2**bits - 1]; see kernels/quant_ref.py for the packing.

    Error bound per group: scale * (1/2 + levels * u + 2**-14) + u * (|min| + |max|)
    + 2**-24 + amax * eps(dtype), with u the relative rounding of the stored meta dtype.
    """

    def __init__(self, bits: int, group_size: int | None = None, kernels_choice: str | None = None):
        group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
        quant_ref.check_lowbit_args(bits, group_size, torch.float16)
        self.bits, self.group_size, self.kernels_choice = bits, group_size, kernels_choice
        self.name = f"int{bits}-g{group_size}"

    @staticmethod
    def _rows(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_layers, _, n_heads, n_tokens, head_dim = block.shape
        keys = block[:, 0].transpose(-1, -2).reshape(-1, n_tokens)  # [L*H*D, T] (copy)
        values = block[:, 1].reshape(-1, head_dim)  # [L*H*T, D]
        return keys, values

    def encode(self, block: torch.Tensor) -> EncodedBlock:
        check_block(block)
        meta = "float16" if float(block.abs().amax()) < FP16_META_LIMIT else "float32"
        payload, sections = [], []
        for kind, rows in zip("kv", self._rows(block)):
            packed, scale, zero = kernels.ops(rows, self.kernels_choice).quantize_lowbit(
                rows, self.bits, self.group_size, META_DTYPES[meta]
            )
            for part, t in (("packed", packed), ("scale", scale), ("zero", zero)):
                payload.append(tensor_bytes(t))
                sections.append([f"{kind}_{part}", len(payload[-1]), t.element_size()])
        params = {"bits": self.bits, "group_size": self.group_size, "meta_dtype": meta, "sections": sections}
        return EncodedBlock(b"".join(payload), params, self.name)

    @staticmethod
    def _row_shapes(shape) -> dict[str, tuple[int, int]]:
        n_layers, _, n_heads, n_tokens, head_dim = shape
        return {"k": (n_layers * n_heads * head_dim, n_tokens), "v": (n_layers * n_heads * n_tokens, head_dim)}

    def check_params(self, params, shape, dtype) -> list[Section]:
        """``bits`` and ``group_size`` the codec's own (its name says them), ``meta_dtype`` one of
        `META_DTYPES`; per k/v, packed codes, then a scale and a zero per group, in that dtype."""
        check_layout(shape, dtype)
        params = param_dict(params, self.name)
        int_param(params, "bits", self.name, self.bits, self.bits, "the codec's")
        int_param(params, "group_size", self.name, self.group_size, self.group_size, "the codec's")
        meta = META_DTYPES[choice_param(params, "meta_dtype", self.name, META_DTYPES)]
        expected = []
        for kind, (n_rows, n_cols) in self._row_shapes(shape).items():
            n_grp = quant_ref.n_groups(n_cols, self.group_size)
            expected += [(f"{kind}_packed", n_rows * quant_ref.packed_cols(n_cols, self.bits, self.group_size), 1),
                         (f"{kind}_scale", n_rows * n_grp * meta.itemsize, meta.itemsize),
                         (f"{kind}_zero", n_rows * n_grp * meta.itemsize, meta.itemsize)]
        return check_sections(params, self.name, expected)

    def decode(self, payload, params, shape, dtype, device="cpu") -> torch.Tensor:
        parts = split_sections(payload, self.check_params(params, shape, dtype))
        bits, group_size, meta = self.bits, self.group_size, META_DTYPES[params["meta_dtype"]]
        n_layers, _, n_heads, n_tokens, head_dim = shape
        rows = self._row_shapes(shape)
        out = {}
        for kind, (n_rows, n_cols) in rows.items():
            n_grp = quant_ref.n_groups(n_cols, group_size)
            packed = parts[f"{kind}_packed"].view(n_rows, -1).to(device)  # [R, Cp*bits/8]
            scale = parts[f"{kind}_scale"].view(meta).view(n_rows, n_grp).to(device)  # [R, NG]
            zero = parts[f"{kind}_zero"].view(meta).view(n_rows, n_grp).to(device)  # [R, NG]
            op = kernels.ops(packed, self.kernels_choice)
            out[kind] = op.dequantize_lowbit(packed, scale, zero, bits, group_size, n_cols, dtype)
        keys = out["k"].view(n_layers, n_heads, head_dim, n_tokens).transpose(-1, -2)  # [L, H, T, D]
        values = out["v"].view(n_layers, n_heads, n_tokens, head_dim)  # [L, H, T, D]
        return torch.stack([keys, values], dim=1)  # [L, 2, H, T, D]

    def error_bound(self, block: torch.Tensor) -> float:
        meta = torch.float16 if float(block.abs().amax()) < FP16_META_LIMIT else torch.float32
        u, levels, g = META_ROUNDING[meta], 2**self.bits - 1, self.group_size
        bound = 0.0
        for rows in self._rows(block):
            rows = rows.float()  # [R, C]
            _, scale, _ = quant_ref.quantize_lowbit(rows, self.bits, g, meta)  # [R, NG]
            pad = scale.shape[1] * g - rows.shape[1]
            padded = torch.cat([rows, rows[:, -1:].expand(-1, pad)], dim=1) if pad else rows
            groups = padded.view(rows.shape[0], -1, g)  # [R, NG, G]
            lo, hi = groups.amin(dim=2), groups.amax(dim=2)  # [R, NG]
            amax = torch.maximum(lo.abs(), hi.abs())
            per_group = (
                scale.float() * (0.5 + levels * u + 2.0**-14)
                + u * (lo.abs() + hi.abs())
                + META_ABS_FLOOR
                + amax * DTYPE_EPS[block.dtype]
            )
            bound = max(bound, float(per_group.max()))
        return bound


# ---------------------------------------------------------------------------------------------
# lossless stages
# ---------------------------------------------------------------------------------------------


class ShuffleStage(LosslessStage):
    """Byte-plane shuffle per section: item i's byte b goes to plane b (like blosc's shuffle).

    For fp16 the sign/exponent bytes form one plane of near-repeating values, which zstd then
    codes well; 1-byte sections pass unchanged.
    """

    name = "shuffle"

    def encode(self, payload, sections):
        return self._apply(payload, sections, inverse=False), {}

    def decode(self, payload, params, sections):
        self.check_params(params, sections)
        return self._apply(payload, sections, inverse=True)

    @staticmethod
    def _apply(payload: bytes, sections: list[Section], inverse: bool) -> bytes:
        """Each section's planes swapped; ValueError unless the sections tile the payload in whole items."""
        total = sum(n for _, n, _ in sections)
        if total != len(payload) or not all(n >= 0 and size >= 1 and n % size == 0 for _, n, size in sections):
            raise ValueError(f"shuffle: payload is {len(payload)} bytes; its sections {sections!r:.160} must tile it "
                             "in whole items")
        buf = np.frombuffer(payload, dtype=np.uint8)
        out, offset = [], 0
        for _, n, itemsize in sections:
            part = buf[offset : offset + n]
            offset += n
            if itemsize > 1:
                shape = (itemsize, n // itemsize) if inverse else (n // itemsize, itemsize)
                part = part.reshape(shape).T
            out.append(np.ascontiguousarray(part))
        return b"".join(p.tobytes() for p in out)


class Lz4Stage(LosslessStage):
    """lz4 block format (no frame); the input size travels in params."""

    name = "lz4"

    def encode(self, payload, sections):
        return lz4.block.compress(payload, store_size=False), {"size": len(payload)}

    def check_params(self, params, sections) -> None:
        """``size``: what the block decompresses to, within `stage_bound` of the quantizer's payload."""
        stage_size(params, self.name, sections)

    def decode(self, payload, params, sections):
        size = stage_size(params, self.name, sections)
        try:
            out = lz4.block.decompress(payload, uncompressed_size=size)
        except lz4.block.LZ4BlockError as exc:
            raise ValueError(f"lz4: the block does not decompress to its {size} bytes: {exc}") from None
        if len(out) != size:
            raise ValueError(f"lz4: the block decompresses to {len(out)} bytes; its size param says {size}")
        return out


class ZstdStage(LosslessStage):
    """zstd at a fixed level (frame with its content size)."""

    def __init__(self, level: int):
        self.level = level
        self.name = "zstd" if level == 1 else f"zstd{level}"

    def encode(self, payload, sections):
        return zstandard.ZstdCompressor(level=self.level).compress(payload), {"level": self.level, "size": len(payload)}

    def check_params(self, params, sections) -> None:
        """``size``: what the frame decompresses to, within `stage_bound` of the quantizer's payload
        (``level`` is the encoder's, not read)."""
        stage_size(params, self.name, sections)

    def decode(self, payload, params, sections):
        size = stage_size(params, self.name, sections)
        try:
            # the frame's own content size is what zstd allocates (it ignores max_output_size then)
            declared = zstandard.frame_content_size(payload)
            if declared != size:
                raise ValueError(f"{self.name}: the frame holds {declared} bytes (-1: unknown); its size param says "
                                 f"{size}")
            out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise ValueError(f"{self.name}: the frame does not decompress: {exc}") from None
        if len(out) != size:
            raise ValueError(f"{self.name}: the frame decompresses to {len(out)} bytes; its size param says {size}")
        return out


def _no_group(name: str, factory):
    def build(group_size: int | None) -> Codec:
        if group_size is not None:
            raise ValueError(f"{name} takes no group size (got -g{group_size}); only int4/int2 do")
        return factory()

    return build


register_quantizer("raw", _no_group("raw", RawCodec))
register_quantizer("int8", _no_group("int8", Int8Codec))
register_quantizer("int4", lambda group_size: LowbitCodec(4, group_size))
register_quantizer("int2", lambda group_size: LowbitCodec(2, group_size))
register_stage("shuffle", ShuffleStage)
register_stage("lz4", Lz4Stage)
register_stage("zstd", lambda: ZstdStage(1))
register_stage("zstd3", lambda: ZstdStage(3))
