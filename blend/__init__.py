"""CacheBlend: reuse the KV of chunks (RAG passages) at any position. See docs/blend.md.

    BlendEngine(model, tokenizer, client).generate(prefix, chunks, query)   blend/engine.py
    split_prompt(tokenizer, text, separator)                                blend/engine.py
"""

import kvstore.kernels_path  # noqa: F401  (`import kernels` is kvstore's, not Hugging Face's: see there)
