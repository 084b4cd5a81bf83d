"""Codec interface, encoded-block record and the registry of codecs by spec string.

A codec turns one KV block ``[layers, 2, kv_heads, tokens, head_dim]`` (float16, bfloat16 or
float32) into an `EncodedBlock` and back. Decoding needs only ``payload + params + shape + dtype``:
`params` is JSON-serialisable and travels in the block header, so any reader decodes any block.

Two kinds of stage, each one class behind a small base:

- `Codec`: the whole block codec. Quantizers (raw, int8, int4, int2) are Codecs; a chain
  ``"int4-g32+shuffle+zstd"`` is a Codec that runs a quantizer, then lossless stages.
- `LosslessStage`: bytes -> bytes, bit-exact. It sees the quantizer's section list (name, byte
  length, item size) so it can filter per section (byte-plane shuffle by item size).

Params are the writer's word (a client's Put, a block in a shared bucket): every codec's
`check_params` holds each one it reads to the block's layout (type, range, the payload length it
implies) before `decode` allocates anything, and raises ValueError naming the param and its bound.

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
    """uint8 CPU tensors for each named section of payload (one copy of the payload in total);
    ValueError unless the sections' lengths (each >= 0) add up to the payload's."""
    buf = payload if isinstance(payload, bytearray) else bytearray(payload)
    if any(n < 0 for _, n, _ in sections):
        raise ValueError(f"section lengths must be >= 0, got {[n for _, n, _ in sections]}")
    total = sum(n for _, n, _ in sections)
    if total != len(buf):
        raise ValueError(f"payload is {len(buf)} bytes, its sections add up to {total}")
    views, offset = {}, 0
    for name, n, _ in sections:
        views[name] = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset) if n else torch.empty(0, dtype=torch.uint8)
        offset += n
    return views


# ---------------------------------------------------------------------------------------------
# codec params: a block header's, so the writer's word (a client's Put, a shared bucket); each
# codec's `check_params` holds them to the block's layout with these before anything is allocated
# ---------------------------------------------------------------------------------------------

_REQUIRED = object()


def check_layout(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """ValueError unless shape is [layers, 2, kv_heads, tokens, head_dim] of positive ints and dtype a block dtype."""
    if len(shape) != 5 or shape[1] != 2 or not all(type(n) is int and n > 0 for n in shape):
        raise ValueError(f"shape must be [layers, 2, kv_heads, tokens, head_dim] of positive ints, got {tuple(shape)}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")


def param_dict(params: Any, codec: str, what: str = "params") -> dict[str, Any]:
    """params itself if it is a JSON object; ValueError naming ``what`` otherwise."""
    if not isinstance(params, dict):
        raise ValueError(f"{codec}: {what} is {type(params).__name__} {params!r:.60}; must be a JSON object")
    return params


def int_param(params: dict[str, Any], key: str, codec: str, lo: int, hi: int, why: str,
              default: int | object = _REQUIRED) -> int:
    """``params[key]``: an int (not a bool, float or string) in lo..hi (``why`` says where the bound
    comes from); ``default`` when absent, if given."""
    value = params.get(key, default)
    if type(value) is not int or not lo <= value <= hi:
        shown = "missing" if value is _REQUIRED else f"{value!r:.60}"
        bound = f"the integer {lo}" if lo == hi else f"an integer in {lo}..{hi}"
        raise ValueError(f"{codec}: {key} is {shown}; must be {bound} ({why})")
    return value


def choice_param(params: dict[str, Any], key: str, codec: str, choices) -> str:
    """``params[key]``: a string among ``choices``."""
    value = params.get(key, _REQUIRED)
    if type(value) is not str or value not in choices:
        shown = "missing" if value is _REQUIRED else f"{value!r:.60}"
        raise ValueError(f"{codec}: {key} is {shown}; must be one of {sorted(choices)}")
    return value


def check_sections(params: dict[str, Any], codec: str, expected: list[tuple[str, int | None, int]],
                   limit: int = 0) -> list[Section]:
    """``params["sections"]`` if it is exactly ``expected``, [name, byte length, item size] each in
    order, as JSON gives it back (ints, not floats or bools). A length given as None is the writer's
    to choose: an int in 0..``limit``. Returns the sections with those lengths filled in."""
    given = params.get("sections", _REQUIRED)
    shown = "missing" if given is _REQUIRED else f"{given!r:.160}"
    need = [[name, "N" if n is None else n, size] for name, n, size in expected]
    if not (isinstance(given, list) and len(given) == len(expected)
            and all(isinstance(g, list) and len(g) == 3 for g in given)):
        raise ValueError(f"{codec}: sections is {shown}; this block's layout needs {need}")
    out = []
    for (name, n, size), (g_name, g_n, g_size) in zip(expected, given):
        if n is None and type(g_n) is int and 0 <= g_n <= limit:
            n = g_n
        if not (type(g_name) is str and g_name == name and type(g_n) is int and g_n == n
                and type(g_size) is int and g_size == size):
            bound = f" (N in 0..{limit})" if any(e[1] is None for e in expected) else ""
            raise ValueError(f"{codec}: sections is {shown}; this block's layout needs {need}{bound}")
        out.append((name, n, size))
    return out


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
        """Rebuild the block (shape, dtype, on device) from payload and params alone; `check_params`
        first, so forged params raise ValueError before anything is allocated."""

    @abstractmethod
    def error_bound(self, block: torch.Tensor) -> float:
        """The largest absolute error this codec promises on this block."""

    @abstractmethod
    def check_params(self, params: Any, shape: tuple[int, ...], dtype: torch.dtype) -> list[Section]:
        """The payload's sections for a block of this shape and dtype with these params, every param
        `decode` reads checked first: its type, its range against the layout, and the byte lengths
        it implies (`check_sections`); ValueError naming the first that does not fit. The sections'
        total is the payload's length (`split_sections` holds the payload to it)."""

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
        """Inverse of encode; sections are the same list encode saw. `check_params` first."""

    def check_params(self, params: Any, sections: list[Section]) -> None:
        """ValueError unless params are what `decode` can undo to at most `stage_bound` of the sections'
        total without allocating more; this base checks they are a JSON object."""
        param_dict(params, self.name)


def stage_bound(size: int) -> int:
    """The most a lossless stage's output may be for ``size`` bytes in (zstd's and lz4's worst case, rounded up)."""
    return size + size // 128 + (1 << 16)


def stage_size(params: Any, stage: str, sections: list[Section]) -> int:
    """A compressing stage's ``size`` param (what it undoes to): an int in 0..`stage_bound` of the
    quantizer's payload (the sections' total), the most any stage's input in the chain may be."""
    total = sum(n for _, n, _ in sections)
    return int_param(param_dict(params, stage), "size", stage, 0, stage_bound(total),
                     f"a compressor's worst case over the quantizer's {total} bytes")


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

    def check_params(self, params, shape, dtype) -> list[Section]:
        """The quantizer's sections, its params (``quant``) checked by it and each stage's by that
        stage, against the most the quantizer's payload may be: the sizes stages allocate by are the
        writer's word (a few KiB of zstd may claim gigabytes)."""
        params = param_dict(params, self.name)
        sections = self.quantizer.check_params(param_dict(params.get("quant"), self.name, "quant"), shape, dtype)
        stages = params.get("stages")
        if not (isinstance(stages, list) and len(stages) == len(self.stages)):
            raise ValueError(f"{self.name}: stages is {stages!r:.80}; must list {len(self.stages)} stage params")
        for stage, p in zip(self.stages, stages):
            stage.check_params(p, sections)
        return sections

    def decode(self, payload, params, shape, dtype, device="cpu") -> torch.Tensor:
        sections = self.check_params(params, shape, dtype)
        for stage, p in reversed(list(zip(self.stages, params["stages"]))):
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
