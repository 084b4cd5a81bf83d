"""Block codecs: quantizers (raw, int8, int4, int2) and lossless stages, chosen by spec string.

    codec = get_codec("int4-g32+shuffle+zstd")
    encoded = codec.encode(block)            # block: [layers, 2, kv_heads, tokens, head_dim]
    block2 = decode_block(encoded, block.shape, block.dtype)

Importing this package needs torch, numpy, lz4 and zstandard, not triton.
"""

import kvstore.kernels_path  # noqa: F401  (`import kernels` is kvstore's, not Hugging Face's: see there)
from compression import codecs, transform  # noqa: F401  (register the codecs)
from compression.base import (
    QUANTIZERS,
    STAGES,
    ChainCodec,
    Codec,
    EncodedBlock,
    LosslessStage,
    decode_block,
    get_codec,
    known_codecs,
)
from compression.codecs import DEFAULT_GROUP_SIZE, DEFAULT_LOSSLESS

__all__ = [
    "QUANTIZERS",
    "STAGES",
    "ChainCodec",
    "Codec",
    "EncodedBlock",
    "LosslessStage",
    "decode_block",
    "get_codec",
    "known_codecs",
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_LOSSLESS",
]
