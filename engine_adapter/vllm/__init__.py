"""kvstore for vLLM: a v1 KV connector (``connector.KVStoreConnector``) and its helpers.

Importing this package does not import vLLM: ``layout`` (paged KV <-> kvstore blocks) and
``hf_folder`` (GGUF -> Hugging Face folder) work without it; ``connector`` and its two sides,
``scheduler`` and ``worker``, need it.
"""
