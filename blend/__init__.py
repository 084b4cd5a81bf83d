"""CacheBlend: reuse the KV of chunks (RAG passages) at any position. See docs/blend.md.

    BlendEngine(model, tokenizer, client).generate(prefix, chunks, query)   engine_adapter/blend_engine.py
    split_prompt(tokenizer, text, separator)                                blend/prompt.py

Blend imports no engine: what it needs from a model is `blend.model`'s protocol.
"""

import kvstore.kernels_path  # noqa: F401  (`import kernels` is kvstore's, not Hugging Face's: see there)
