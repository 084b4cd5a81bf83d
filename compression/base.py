"""Codec interface, encoded-block record and the registry of codecs by spec string.

A codec turns one KV block ``[layers, 2, kv_heads, tokens, head_dim]`` (float16, bfloat16 or
float32) into an `EncodedBlock` and back. Decoding needs only ``payload + params + shape + dtype``:
`params` is JSON-serialisable and travels in the block header, so any reader decodes any block.

Two kinds of stage, each one class behind a small base:

- `Codec`: the whole block codec. Quantizers (raw, int8, int4, int2) are Codecs; a chain
  ``"int4-g32+shuffle+zstd"`` is a Codec that runs a quantizer, then lossless stages.
- `LosslessStage`: bytes -> bytes, bit-exact. It sees the quantizer's section list (name, byte
  length, item size) so it can filter per section (byte-plane shuffle by item size).

Spec grammar for `get_codec`: ``<quantizer>[-g<group_size>]{+<stage>}``, e.g. ``"raw"``,
``"int8"``, ``"int4-g32"``, ``"raw+lz4"``, ``"int8+shuffle+zstd"``. The names are the keys of
`QUANTIZERS` and `STAGES`, filled by `compression/codecs.py` when the package is imported.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# one ulp at 1.0 of each block dtype: the most a final cast (round to nearest, or truncation in the
# Triton interpreter) moves a value, relative to its magnitude
DTYPE_EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}

Section = tuple[str, int, int]  # (name, byte length, item size in bytes), in payload order


@dataclass(frozen=True)
class EncodedBlock:
    """One encoded block: what a tier stores, plus the header fields needed to decode it."""

    payload: bytes
    params: dict[str, Any] = field(hash=False)  # JSON-serialisable; goes into the block header
    codec: str  # the codec's canonical spec, e.g. "int4-g32+shuffle+zstd"; get_codec(codec) decodes

    @property
    def nbytes(self) -> int:
        return len(self.payload)


def check_block(block: torch.Tensor) -> None:
    """Raise ValueError unless block is a float KV block [layers, 2, kv_heads, tokens, head_dim]."""
    if block.dim() != 5 or block.shape[1] != 2:
        raise ValueError(f"a KV block is [layers, 2, kv_heads, tokens, head_dim], got {tuple(block.shape)}")
    if block.dtype not in FLOAT_DTYPES:
        raise ValueError(f"block dtype must be one of {FLOAT_DTYPES}, got {block.dtype}")
    if block.numel() == 0:
        raise ValueError(f"block is empty: {tuple(block.shape)}")


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of t in C order (one copy), for any dtype including bfloat16."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def split_sections(payload: bytes | bytearray, sections: list[Section]) -> dict[str, torch.Tensor]:
    """uint8 CPU tensors for each named section of payload (one copy of the payload in total)."""
    buf = payload if isinstance(payload, bytearray) else bytearray(payload)
    total = sum(n for _, n, _ in sections)
    if total != len(buf):
        raise ValueError(f"payload is {len(buf)} bytes, its sections add up to {total}")
    views, offset = {}, 0
    for name, n, _ in sections:
        views[name] = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset) if n else torch.empty(0, dtype=torch.uint8)
        offset += n
    return views


class Codec(ABC):
    """Encodes a KV block to bytes and back; stateless and safe to share between threads.

    `error_bound(block)` is the codec's promise: for every element, |decode(encode(block)) - block|
    is at most that many (absolute units of the block). Lossless codecs promise 0.
    """

    name: str  # canonical spec: get_codec(name) builds an equal codec ("int4" -> "int4-g32")
    lossless: bool = False

    @abstractmethod
    def encode(self, block: torch.Tensor) -> EncodedBlock:
        """block: [layers, 2, kv_heads, tokens, head_dim] -> EncodedBlock; raises ValueError."""

    @abstractmethod
    def decode(
        self,
        payload: bytes,
        params: dict[str, Any],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Rebuild the block (shape, dtype, on device) from payload and params alone."""

    @abstractmethod
    def error_bound(self, block: torch.Tensor) -> float:
        """The largest absolute error this codec promises on this block."""

    def payload_bytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: dict[str, Any]) -> int | None:
        """The exact size of the payload `decode` takes for this shape (None: not known up front)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class LosslessStage(ABC):
    """bytes -> bytes, reversed bit-exactly by `decode`; `sections` describe the input's layout."""

    name: str

    @abstractmethod
    def encode(self, payload: bytes, sections: list[Section]) -> tuple[bytes, dict[str, Any]]:
        """-> (encoded bytes, JSON-serialisable params needed by decode)."""

    @abstractmethod
    def decode(self, payload: bytes, params: dict[str, Any], sections: list[Section]) -> bytes:
        """Inverse of encode; sections are the same list encode saw."""


def stage_bound(size: int) -> int:
    """The most a lossless stage's output may be for ``size`` bytes in (zstd's and lz4's worst case, rounded up)."""
    return size + size // 128 + (1 << 16)


class ChainCodec(Codec):
    """A quantizer followed by lossless stages, e.g. int4-g32 -> shuffle -> zstd.

    params = {"quant": <quantizer params, with "sections">, "stages": [<stage params>, ...]};
    the stage params are listed in encode order and undone in reverse.
    """

    def __init__(self, quantizer: Codec, stages: list[LosslessStage]):
        if isinstance(quantizer, ChainCodec) or not stages:
            raise ValueError("a chain is one quantizer followed by at least one lossless stage")
        self.quantizer = quantizer
        self.stages = stages
        self.name = "+".join([quantizer.name] + [s.name for s in stages])
        self.lossless = quantizer.lossless

    def encode(self, block: torch.Tensor) -> EncodedBlock:
        inner = self.quantizer.encode(block)
        sections = [tuple(s) for s in inner.params["sections"]]
        payload, stage_params = inner.payload, []
        for stage in self.stages:
            payload, p = stage.encode(payload, sections)
            stage_params.append(p)
        return EncodedBlock(payload, {"quant": inner.params, "stages": stage_params}, self.name)

    def decode(self, payload, params, shape, dtype, device="cpu") -> torch.Tensor:
        sections = [tuple(s) for s in params["quant"]["sections"]]
        if len(params["stages"]) != len(self.stages):
            raise ValueError(f"params list {len(params['stages'])} stages, {self.name!r} has {len(self.stages)}")
        # The sizes stages allocate by are the writer's word (a few KiB of zstd may claim gigabytes):
        # the first stage undoes to the quantizer's payload, whose exact size the shape gives; a later
        # stage to an earlier one's output, at most a compressor's worst case above it.
        total = sum(int(n) for _, n, _ in sections)
        exact = self.quantizer.payload_bytes(tuple(shape), dtype, params["quant"])
        if exact is not None and total != exact:
            raise ValueError(f"params' sections add up to {total} bytes; {self.quantizer.name} of shape "
                             f"{tuple(shape)} is {exact}")
        for i, (stage, p) in reversed(list(enumerate(zip(self.stages, params["stages"])))):
            size = p.get("size")
            if size is not None and (int(size) != total if i == 0 else not 0 <= int(size) <= stage_bound(total)):
                raise ValueError(f"stage {stage.name} says it undoes to {size} bytes; its input is "
                                 f"{'exactly' if i == 0 else 'at most'} {total if i == 0 else stage_bound(total)}")
            payload = stage.decode(payload, p, sections)
        return self.quantizer.decode(payload, params["quant"], shape, dtype, device)

    def error_bound(self, block: torch.Tensor) -> float:
        return self.quantizer.error_bound(block)


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------

QuantizerFactory = Callable[[int | None], Codec]  # group_size from "-g<N>" (None: default) -> Codec
QUANTIZERS: dict[str, QuantizerFactory] = {}
STAGES: dict[str, Callable[[], LosslessStage]] = {}
# quantizers that need a calibration, spelled "<name>[-<option>]@<calibration id>": name -> parser(head)
CALIBRATED: dict[str, Callable[[str], Codec]] = {}


def register_quantizer(name: str, factory: QuantizerFactory) -> None:
    QUANTIZERS[name] = factory


def register_stage(name: str, factory: Callable[[], LosslessStage]) -> None:
    STAGES[name] = factory


def register_calibrated(name: str, parser: Callable[[str], Codec]) -> None:
    CALIBRATED[name] = parser


def known_codecs() -> str:
    return (
        f"quantizers {sorted(QUANTIZERS)} (int4/int2 take -g<group_size>, e.g. int4-g32), "
        f"calibrated {sorted(CALIBRATED)} (e.g. 'kvtc@<calibration id>', see `kvstore calibrate`), "
        f"lossless stages {sorted(STAGES)} joined with '+', e.g. 'int8+shuffle+zstd'"
    )


def get_codec(spec: str) -> Codec:
    """The codec for a spec like "int4-g32+shuffle+zstd"; ValueError naming the known ones."""
    head, *stage_names = spec.split("+")
    if "@" in head:
        name = head.partition("@")[0].partition("-")[0]
        if name not in CALIBRATED:
            raise ValueError(f"unknown calibrated codec {name!r} in {spec!r}; known: {known_codecs()}")
        for stage in stage_names:
            if stage not in STAGES:
                raise ValueError(f"unknown lossless stage {stage!r} in {spec!r}; known: {known_codecs()}")
        quantizer = CALIBRATED[name](head)
        return ChainCodec(quantizer, [STAGES[s]() for s in stage_names]) if stage_names else quantizer
    quant_name, has_group, group = head.partition("-g")
    if quant_name not in QUANTIZERS:
        raise ValueError(f"unknown codec {quant_name!r} in {spec!r}; known: {known_codecs()}")
    group_size = None
    if has_group:
        if not group.isdigit():
            raise ValueError(f"group size in {spec!r} must be an integer, e.g. 'int4-g32'")
        group_size = int(group)
    for stage in stage_names:
        if stage not in STAGES:
            raise ValueError(f"unknown lossless stage {stage!r} in {spec!r}; known: {known_codecs()}")
    quantizer = QUANTIZERS[quant_name](group_size)
    if not stage_names:
        return quantizer
    return ChainCodec(quantizer, [STAGES[s]() for s in stage_names])


def decode_block(
    encoded: EncodedBlock, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Decode any block from its header fields: the codec spec picks the codec."""
    return get_codec(encoded.codec).decode(encoded.payload, encoded.params, shape, dtype, device)
