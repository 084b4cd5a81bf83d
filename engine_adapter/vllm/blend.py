"""CacheBlend inside vLLM: a RAG prompt's passages reused at any position (no vLLM import here).

A request asks for blending with ``kv_transfer_params`` (vLLM passes them through
``SamplingParams.extra_args``, and its OpenAI server through the request body)::

    {"kvstore_blend": {"lengths": [prefix, passage 1, ..., passage n],   # token counts, in order; none:
                                                                       # the text's separators mark them
                       "ratio": 0.15,                                  # optional: float in [0, 1] or "auto"
                       "selector": "stale_attention"}}                 # optional: blend.select name

The prompt's tokens are ``prefix + passage 1 + ... + passage n + query``; the query (at least one
token) is what follows the lengths. :func:`blend_request` builds both from text marked with the
separator of ``blend.prompt.split_prompt``, each part tokenized on its own, so a passage's tokens,
and its chunk key, are the same in every prompt and in ``BlendEngine``.

Or a text prompt carries the markers itself (``prefix<sep>passage<sep>...<sep>query``, the
connector's ``blend_separator``) and vLLM tokenizes it whole: :func:`separated_spec` cuts it with
``blend.prompt.split_tokens``. The separators' tokens are glue, computed on every layer
(`blend.assemble`); each passage is its tokens in place, the same in every prompt, and the same
blocks ``BlendEngine`` uses for ``split_prompt(..., whole=True)``.

One request's blend has one form from the scheduler's reading to the recompute::

    kv_transfer_params / markers  ->  BlendSpec      what the request asks (blend_spec, separated_spec;
                                                     ratio and selector checked here, once)
    + prompt, vLLM's own hit      ->  BlendRequest   with the ratio and selector it runs with: the
                                                     request's, else the deployment's; its Ratio is
                                                     fixed or AUTO (the loading controller's)
    + vLLM's pages                ->  BlendRequest   (span set), in the step's plan, to the worker
    worker                            VllmBlender.run -> BlendEngine.prefill -> blend_prefill

Through the connector (``scheduler.py``, ``worker.py``)::

    scheduler  get_num_new_matched_tokens  a blend request reports prefix + passages as external hits
               update_state_after_alloc    the pages of those tokens (after vLLM's own hit)
               build_connector_meta        the step's BlendRequests, in its plan
    worker     start_load_kv               VllmBlender: BlendEngine.prefill over the same weights
                                           (passages by chunk key from the daemon, missing ones
                                           computed alone), then the blended KV into vLLM's pages
               vLLM's forward              the query only
               wait_for_save               passages computed alone are stored (background thread)

Blended KV is never stored under prefix keys: it is not the exact KV of its token prefix.
"""

from __future__ import annotations

import logging
import reprlib
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from blend.controller import Ratio
from blend.prompt import DEFAULT_RATIO, DEFAULT_SEPARATOR, split_prompt, split_tokens
from engine_adapter.blend_engine import BlendEngine
from blend.select import DEFAULT_SELECTOR, SELECTORS, check_selector
from engine_adapter.vllm.layout import PagedSpan

if TYPE_CHECKING:
    from torch import nn

    from engine_adapter.blend_engine import BlendedPrompt
    from engine_adapter.reference.model import LlamaModel
    from engine_adapter.client.prefix_cache import PrefixCache
    from engine_adapter.reference.tokenizer import Tokenizer
    from engine_adapter.vllm.layout import PagedKV
    from kvstore.keys import Namespace

log = logging.getLogger("vllm.kvstore_connector")

_BRIEF = reprlib.Repr()
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxset = _BRIEF.maxdict = 8
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlevel = 2


def brief(value: Any) -> str:
    """A client's value (a request id, a field of its parameters) as it goes into a log line or an
    error: repr, so a newline cannot forge another line, and cut short, so a million-element list
    cannot make a megabyte line."""
    try:
        return _BRIEF.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int past Python's digit limit: name its type only
        return f"<{type(value).__name__}>"


BLEND_PARAM = "kvstore_blend"


@dataclass(frozen=True)
class BlendSpec:
    """What one request asks to blend: segment lengths (prefix, then passages), ratio and selector
    (None: the request names none, the deployment's apply; `BlendRequest` settles them)."""

    lengths: tuple[int, ...]
    ratio: Ratio | None = None
    selector: str | None = None
    glue: tuple[int, ...] = ()  # separator tokens just before each passage (text markers); () for none

    @property
    def cached_tokens(self) -> int:
        """Tokens before the query: what the blend writes and vLLM need not compute."""
        return sum(self.lengths) + sum(self.glue)

    def parts(self, prompt: Sequence[int]) -> tuple[list[int], list[list[int]], list[int], list[list[int]]]:
        """(prefix, passages, query, glue before each passage) of ``prompt``."""
        prompt = list(prompt)
        glue = self.glue or (0,) * (len(self.lengths) - 1)
        prefix, at = prompt[: self.lengths[0]], self.lengths[0]
        passages, glues = [], []
        for g, n in zip(glue, self.lengths[1:]):
            glues.append(prompt[at: at + g])
            passages.append(prompt[at + g: at + g + n])
            at += g + n
        return prefix, passages, prompt[at:], glues


def blend_spec(params: dict[str, Any] | None, prompt_tokens: int) -> BlendSpec | None:
    """The blend a request's ``kv_transfer_params`` ask for; None when they ask for none. Raises
    ValueError (one line, naming the field) for a malformed request."""
    if not params or BLEND_PARAM not in params:
        return None
    spec = params[BLEND_PARAM]
    if not isinstance(spec, dict):
        raise ValueError(f"kv_transfer_params[{BLEND_PARAM!r}] must be an object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - {"lengths", "ratio", "selector"})
    if unknown:
        raise ValueError(f"kv_transfer_params[{BLEND_PARAM!r}] has unknown keys {brief(unknown)}; known: lengths, ratio, "
                         f"selector")
    lengths = spec.get("lengths")
    if lengths is None:
        lengths = ()  # the prompt's text marks the passages (blend_separator); ratio and selector apply
    elif not isinstance(lengths, (list, tuple)) or not lengths or \
            not all(isinstance(n, int) and not isinstance(n, bool) for n in lengths):
        raise ValueError(f"{BLEND_PARAM}.lengths must be a list of token counts [prefix, passage, ...], got {brief(lengths)}")
    if lengths and (lengths[0] < 0 or any(n <= 0 for n in lengths[1:])):
        raise ValueError(f"{BLEND_PARAM}.lengths: the prefix must be >= 0 tokens and every passage > 0, got {brief(lengths)}")
    if lengths and sum(lengths) >= prompt_tokens:
        raise ValueError(f"{BLEND_PARAM}.lengths cover {brief(sum(lengths))} of the prompt's {prompt_tokens} tokens; "
                         f"the query needs at least one")
    ratio, selector = spec.get("ratio"), spec.get("selector")
    try:
        ratio = None if ratio is None else Ratio.parse(ratio)
    except ValueError:
        raise ValueError(f"{BLEND_PARAM}.ratio must be a number in [0, 1] or \"auto\", got {brief(ratio)}") from None
    try:
        selector = None if selector is None else check_selector(selector)
    except ValueError:
        raise ValueError(f"{BLEND_PARAM}.selector {brief(selector)} is unknown; known: {sorted(SELECTORS)}") from None
    return BlendSpec(tuple(int(n) for n in lengths), ratio, selector)


def blend_request(tokenizer: "Tokenizer", text: str, separator: str = DEFAULT_SEPARATOR,
                  ratio: float | str | None = None, selector: str | None = None) -> tuple[list[int], dict[str, Any]]:
    """Prompt token ids and ``kv_transfer_params`` for ``text`` marked as for
    ``blend.prompt.split_prompt`` (``prefix<sep>passage<sep>...<sep>query``)::

        ids, params = blend_request(tokenizer, text)
        llm.generate(TokensPrompt(prompt_token_ids=ids),
                     SamplingParams(max_tokens=64, extra_args={"kv_transfer_params": params}))
    """
    prompt = split_prompt(tokenizer, text, separator)
    ids = prompt.prefix + [t for chunk in prompt.chunks for t in chunk] + prompt.query
    spec: dict[str, Any] = {"lengths": [len(prompt.prefix), *(len(c) for c in prompt.chunks)]}
    if ratio is not None:
        spec["ratio"] = ratio
    if selector is not None:
        spec["selector"] = selector
    return ids, {BLEND_PARAM: spec}


MAX_GLUE_SHARE = 0.25  # of the tokens before the query: beyond it, markers cost more than they save


def check_blend_cost(spec: BlendSpec, max_passages: int) -> None:
    """ValueError (one line) for a blend that would cost the engine more than vLLM's own prefill
    saves: more than ``max_passages`` passages (each a lookup, a load and, when missing, a prefill
    of its own), or separators (glue, computed on every layer) over a quarter of the tokens before
    the query. A client may send either on purpose; such a request is served as a plain prompt."""
    passages = len(spec.lengths) - 1
    if passages > max_passages:
        raise ValueError(f"{passages} passages marked; at most {max_passages} are blended (blend_max_passages)")
    glue = sum(spec.glue)
    if glue > MAX_GLUE_SHARE * spec.cached_tokens:
        raise ValueError(f"separators are {glue} of the {spec.cached_tokens} tokens before the query; "
                         f"at most {MAX_GLUE_SHARE:.0%} may be")


def separated_spec(tokenizer: "Tokenizer", prompt: Sequence[int], separator: str) -> BlendSpec | None:
    """The blend a tokenized text prompt marks with ``separator``, cut by
    ``blend.prompt.split_tokens`` (separator tokens are glue; the last one's go with the query,
    which vLLM computes), or None: no separator, or one only (no passage: a plain prompt). Raises
    ValueError (one line) for ids that are not their text's tokenization or an empty query."""
    cut = split_tokens(tokenizer, prompt, separator)
    if cut is None or not cut.chunks:
        return None
    return BlendSpec((len(cut.prefix), *(len(c) for c in cut.chunks)), glue=tuple(len(g) for g in cut.glue))


class BlendRequests:
    """The scheduler's reading of blend requests: each request's ``kv_transfer_params`` and, with a
    ``separator``, the markers in its text, checked against the cost limits, once per request (a
    request is asked about at every scheduling attempt). A request that cannot be blended is logged
    once and answered None: it is served as a plain prompt."""

    def __init__(self, separator: str, tokenizer_folder: str | Path, max_passages: int, logger=log) -> None:
        self.separator = separator
        self.tokenizer_folder = tokenizer_folder
        self.max_passages = max_passages
        self._log = logger
        self._specs: dict[str, BlendSpec | None] = {}
        self._tokenizer: "Tokenizer | None | bool" = None  # loaded on the first marked read; False: none

    def spec(self, request_id: str, prompt: Sequence[int], params: dict[str, Any] | None) -> BlendSpec | None:
        if request_id not in self._specs:
            try:
                self._specs[request_id] = self._read(prompt, params)
            except Exception as exc:  # noqa: BLE001 - no request may break the scheduler: a plain prompt
                self._log.warning("KVStoreConnector: request %s is served without blending: %s", brief(request_id), exc)
                self._specs[request_id] = None
        return self._specs[request_id]

    def forget(self, request_id: str) -> None:
        self._specs.pop(request_id, None)

    def _read(self, prompt: Sequence[int], params: dict[str, Any] | None) -> BlendSpec | None:
        spec = blend_spec(params, len(prompt))
        if spec is None or not spec.lengths:  # the text's markers, with the request's ratio and selector if any
            tokenizer = self._marker_tokenizer()
            marked = separated_spec(tokenizer, prompt, self.separator) if tokenizer else None
            spec = marked if spec is None or marked is None else replace(marked, ratio=spec.ratio, selector=spec.selector)
        if spec is None or spec.cached_tokens == 0:
            return None
        check_blend_cost(spec, self.max_passages)
        return spec

    def _marker_tokenizer(self) -> "Tokenizer | None":
        """The model's tokenizer, to find the separator in prompts (loaded once); None when markers
        are off or it cannot be read (logged once)."""
        if self._tokenizer is None:
            self._tokenizer = False
            if self.separator:
                from engine_adapter.reference.tokenizer import Tokenizer

                try:
                    self._tokenizer = Tokenizer.from_folder(self.tokenizer_folder)
                except Exception as exc:  # noqa: BLE001 - without a tokenizer, markers are not read
                    self._log.warning("KVStoreConnector: passage markers (%r) are not read: the tokenizer in %s "
                                      "cannot be loaded (%s); kv_transfer_params still mark blends",
                                      self.separator, self.tokenizer_folder, exc)
        return self._tokenizer or None


@dataclass(frozen=True)
class BlendRequest:
    """One request's blend as the worker runs it, from the scheduler's reading to the recompute:
    tokens ``hit .. spec.cached_tokens - 1`` of ``token_ids`` blended and written into ``span``.

    ``hit`` is vLLM's own prefix-cache hit, whose pages it already holds. ``ratio`` and
    ``selector`` are what the blend runs with, settled once (:meth:`of`): the request's, else the
    deployment's. ``span`` is None until vLLM allocated the pages (``update_state_after_alloc``).
    """

    request_id: str
    token_ids: tuple[int, ...]
    spec: BlendSpec
    hit: int
    ratio: Ratio           # fixed, or Ratio.AUTO: the worker's loading controller picks it per blend
    selector: str
    span: PagedSpan | None = None

    @classmethod
    def of(cls, request_id: str, token_ids: Sequence[int], spec: BlendSpec, hit: int, ratio: Ratio,
           selector: str) -> "BlendRequest":
        """``spec``'s blend with the deployment's ``ratio`` (AUTO where it runs a controller) and
        ``selector`` where the request names none. A request's "auto" is the controller's choice
        where the deployment runs one, else the deployment's fixed ratio."""
        asked = spec.ratio
        return cls(request_id, tuple(token_ids), spec, hit, ratio if asked is None or asked.auto else asked,
                   spec.selector or selector)


class VllmBlender:
    """The worker's blend: ``BlendEngine`` over the model's weights, its KV written into vLLM's pages.

    The model is set up on the first blend (``blend: lazy``) or at start (``start``). With
    ``vllm_model`` (a callable that finds vLLM's live model, or None) it is a `VllmModelView`: the
    blend computes with vLLM's own layers and weights, nothing copied. Without it, or where that
    model does not fit the view, the weights are a second copy loaded from vLLM's model folder
    (``load_hf_folder``) on ``device``: the device of vLLM's KV pages, so that on a GPU the blend
    runs there and its KV reaches the pages without a host trip. ``weights`` says which ("vllm" or
    "copy"). ``BlendEngine`` shares the connector's guarded daemon link and namespace, so passages
    are the same blocks ``BlendEngine`` stores anywhere.
    """

    def __init__(self, folder: str | Path, dtype: torch.dtype, cache: "PrefixCache", namespace: "Namespace",
                 ratio: float = DEFAULT_RATIO, selector: str = DEFAULT_SELECTOR, controller: bool = False,
                 device: torch.device | str = "cpu", vllm_model: Callable[[], nn.Module | None] | None = None) -> None:
        self.folder = Path(folder)
        self.dtype = dtype
        self.device = torch.device(device)
        self.vllm_model = vllm_model
        self.weights = ""  # "vllm" or "copy" once the model is set up
        self.cache = cache
        self.namespace = namespace
        self.ratio = ratio
        self.selector = selector
        self.controller = controller
        self._engine: BlendEngine | None = None
        self._lock = threading.Lock()
        self.blended = 0
        self.seconds = 0.0

    def engine(self) -> BlendEngine:
        with self._lock:
            if self._engine is None:
                from blend.controller import LoadingController

                model, tokenizer = self._model()
                layout = self.namespace.layout
                if (model.config.num_layers, model.config.num_kv_heads, model.config.head_dim) != \
                        (layout.num_layers, layout.num_kv_heads, layout.head_dim):
                    raise ValueError(f"the model in {self.folder} does not match vLLM's KV layout {layout}")
                controller = LoadingController(layout.num_layers) if self.controller else None
                self._engine = BlendEngine(model, tokenizer, None, selector=self.selector, ratio=self.ratio,
                                           controller=controller,
                                           cache=self.cache, namespace=self.namespace)
            return self._engine

    def _model(self) -> tuple[LlamaModel, Tokenizer]:
        """The blend's model: a view of vLLM's own where it fits, else a copy from the folder."""
        from engine_adapter.reference import loader

        if self.vllm_model is not None:
            from engine_adapter.vllm.model_view import VllmModelView, view_problem

            config, tokenizer, _ = loader.hf_folder_config(self.folder)
            found = self.vllm_model()
            problem = "vLLM's model was not found" if found is None else view_problem(found, config)
            if problem is None:
                self.weights = "vllm"
                log.info("KVStoreConnector: blend computes with vLLM's own layers (%s, %s)", type(found).__name__,
                         self.device)
                return VllmModelView(config, found, self.dtype, self.device), tokenizer
            log.warning("KVStoreConnector: blend loads a second copy of the weights (%s)", problem)
        model, tokenizer = loader.load_hf_folder(self.folder, dtype=self.dtype, device=self.device)
        self.weights = "copy"
        log.info("KVStoreConnector: blend model loaded from %s (%s, %s)", self.folder, self.dtype, self.device)
        return model, tokenizer

    def run(self, request: BlendRequest, paged: "PagedKV") -> "BlendedPrompt":
        """Blend ``request`` and write tokens ``request.hit ..`` of the blended KV into its pages."""
        engine = self.engine()
        prefix, passages, query, glue = request.spec.parts(request.token_ids)
        # vLLM computes the query itself: only the passages' KV is blended here
        blended = engine.prefill(prefix, passages, query, ratio=request.ratio, selector=request.selector,
                                 kv_only=True, glue=glue)
        end = request.spec.cached_tokens
        if request.hit < end:
            paged.scatter(blended.kv.span(request.hit, end), request.span)  # a view of the blend's cache
        result = blended.result
        self.blended += 1
        self.seconds += result.load_s + result.blend_s
        # one line a blend: what an operator asks first is whether its passages came from the cache
        # or were computed alone (a blend costs 0.1-4 s on a CPU; where blends are many and fast, on
        # a GPU, set the "vllm.kvstore_connector" logger to WARNING)
        segments = len(blended.layout.cached)
        log.info("KVStoreConnector: blended request %s: %d of %d segments from the cache, %d of %d passage "
                 "tokens recomputed (ratio %.2f, %s), load %.1f ms, blend %.1f ms", brief(request.request_id),
                 segments - result.computed_segments, segments, result.recomputed_tokens, result.chunk_tokens,
                 result.ratio, result.selector, result.load_s * 1e3, result.blend_s * 1e3)
        return blended
