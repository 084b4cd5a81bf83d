"""vLLM's paged KV cache <-> kvstore blocks, and the connector's plan and settings: no vLLM process.

Pure torch and Python against `engine_adapter/vllm/layout.py`, `plan.py` and the connector's
settings, plus vLLM's own CPU cache-write op where a test names it. Needs vLLM importable, like
tests/test_vllm.py (the real-vLLM scenario): CI runs both from .venv-vllm (see .ci/run); the main
suite skips this module.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here; CI runs this module from .venv-vllm (see .ci/run)",
                allow_module_level=True)

from engine_adapter.vllm.layout import PagedKV, PagedSpan, PageLayout, measure_page_layout  # noqa: E402
from engine_adapter.vllm.plan import Planner  # noqa: E402
from kernels.page_copy import PageWriter  # noqa: E402
from kvstore.keys import KVLayout, Namespace, prefix_keys  # noqa: E402

pytestmark = pytest.mark.vllm

CHUNK = 256


def packed_write(key, value, plane, slots):
    """A made-up packed backend: per (page, head), K stored dim-major [D, N], V in pairs of rows."""
    pages, heads, page_tokens, two_d = plane.shape
    d = two_d // 2
    halves = plane.view(pages, heads, 2, page_tokens * d)
    for t, slot in enumerate(slots.tolist()):
        page, row = divmod(slot, page_tokens)
        k = halves[page, :, 0].view(heads, d, page_tokens)
        k[:, :, row] = key[t]
        v = halves[page, :, 1].view(heads, page_tokens // 2, d, 2)
        v[:, row // 2, :, row % 2] = value[t]


def test_measured_layout_matches_the_write_op():
    heads, page_tokens, head_dim = 3, 16, 8
    layout = measure_page_layout(packed_write, heads, page_tokens, head_dim, torch.bfloat16)
    assert layout.page_tokens == page_tokens and layout.head_dim == head_dim
    # what the op writes, PagedKV reads back as K and V; what PagedKV writes, is what the op writes
    cache = torch.zeros(6, heads, page_tokens, 2 * head_dim, dtype=torch.bfloat16)
    slots = torch.tensor([3 * page_tokens + 5, 3 * page_tokens + 6, 0 * page_tokens + 15, 5 * page_tokens])
    key, value = (torch.randn(4, heads, head_dim).to(torch.bfloat16) for _ in range(2))
    packed_write(key, value, cache, slots)
    paged = PagedKV([cache], layout, heads, page_tokens)
    for t, slot in enumerate(slots.tolist()):
        block = paged.gather(PagedSpan((slot // page_tokens,), slot % page_tokens, 1))  # [1, 2, H, 1, D]
        assert torch.equal(block[0, 0, :, 0], key[t]) and torch.equal(block[0, 1, :, 0], value[t])
    ours = torch.zeros_like(cache)
    paged = PagedKV([ours], layout, heads, page_tokens)
    for t, slot in enumerate(slots.tolist()):
        kv = torch.stack((key[t], value[t])).unsqueeze(2).unsqueeze(0)  # [1, 2, H, 1, D]
        paged.scatter(kv, PagedSpan((slot // page_tokens,), slot % page_tokens, 1))
    assert torch.equal(ours, cache)


def test_written_down_layouts():
    page_tokens, head_dim = 4, 2
    split = PageLayout.split(page_tokens, head_dim)  # row r = [K | V]
    assert split.plane_rows[1, 3].tolist() == [3, 3] and split.plane_cols[1, 3].tolist() == [2, 3]
    halves = PageLayout.halves(page_tokens, head_dim)  # memory [2N, D]: K rows then V rows
    assert halves.plane_rows[1, 0].tolist() == [2, 2] and halves.plane_cols[1, 0].tolist() == [0, 1]
    with pytest.raises(ValueError, match="exactly once"):
        PageLayout.from_offsets(torch.zeros(2, page_tokens, head_dim, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_heads=3"):
        PagedKV([torch.zeros(2, 2, page_tokens, 2 * head_dim)], split, 3, page_tokens)


@pytest.mark.parametrize("kind", ["split", "halves"])
@pytest.mark.parametrize("page_tokens,kernel_tokens,offset", [(32, 32, 0), (48, 48, 7), (64, 32, 30), (16, 16, 5)])
def test_scatter_then_gather_round_trips_on_irregular_page_tables(kind, page_tokens, kernel_tokens, offset):
    layers, heads, head_dim, tokens = 3, 2, 8, 100
    kernel_pages = 40 * (page_tokens // kernel_tokens)
    caches = [torch.zeros(kernel_pages, heads, kernel_tokens, 2 * head_dim, dtype=torch.bfloat16) for _ in range(layers)]
    layout = getattr(PageLayout, kind)(kernel_tokens, head_dim)
    paged = PagedKV(caches, layout, heads, page_tokens)
    page_ids = [17, 3, 29, 8, 11, 0, 36, 21][: (offset + tokens + page_tokens - 1) // page_tokens]
    span = PagedSpan(tuple(page_ids), offset, tokens)
    generator = torch.Generator().manual_seed(page_tokens * 1000 + offset)  # the same bytes every run
    block = torch.randn(layers, 2, heads, tokens, head_dim, generator=generator).to(torch.bfloat16)
    block[block == 0] = 1  # a zero would read as "not written" below
    paged.scatter(block, span)
    assert torch.equal(paged.gather(span), block)
    assert sum(int((c != 0).sum()) for c in caches) == block.numel()  # nothing else was written
    # the last token's K of layer 2, head 1 is where the page table and the layout put it
    i = tokens - 1
    page, row = page_ids[(offset + i) // page_tokens], (offset + i) % page_tokens
    kernel_page = page * (page_tokens // kernel_tokens) + row // kernel_tokens
    r = row % kernel_tokens
    placed = caches[2][kernel_page, 1, layout.plane_rows[0, r], layout.plane_cols[0, r]]
    assert torch.equal(placed, block[2, 0, 1, i])


def test_vllm_cpu_kernel_pages_read_back_through_the_measured_layout():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from engine_adapter.vllm.layout import cpu_cache_write

    heads, page_tokens, head_dim = 3, 128, 64  # SmolLM2's heads and head size; vLLM's CPU page
    isa = _get_attn_isa(torch.bfloat16, page_tokens, head_dim)
    write = cpu_cache_write(isa)
    layout = measure_page_layout(write, heads, page_tokens, head_dim, torch.bfloat16)
    # a sequence of 178 tokens in pages (2, 0): one whole page and 50 rows, written by vLLM's kernel
    span = PagedSpan((2, 0), 0, 178)
    slots = torch.cat((torch.arange(2 * page_tokens, 3 * page_tokens), torch.arange(0, 50)))
    key, value = (torch.randn(178, heads, head_dim).to(torch.bfloat16) for _ in range(2))
    theirs = torch.zeros(4, heads, page_tokens, 2 * head_dim, dtype=torch.bfloat16)
    write(key, value, theirs, slots)
    block = PagedKV([theirs], layout, heads, page_tokens).gather(span)  # [1, 2, H, T, D]
    assert torch.equal(block[0, 0], key.transpose(0, 1)) and torch.equal(block[0, 1], value.transpose(0, 1)), isa
    ours = torch.zeros_like(theirs)
    PagedKV([ours], layout, heads, page_tokens).scatter(block, span)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("page_tokens,kernel_tokens,offset,tokens", [(32, 32, 0, 100), (64, 32, 30, 77), (16, 16, 5, 3)])
def test_write_op_scatter_and_page_copies_match_the_layout_path(page_tokens, kernel_tokens, offset, tokens):
    """The fast paths (the backend's write op with a slot mapping; a plain page copy permuted later)
    give exactly what the per-element layout path gives, on an irregular page table."""
    from engine_adapter.vllm.layout import split_cache_write

    layers, heads, head_dim = 3, 2, 8
    kernel_pages = 40 * (page_tokens // kernel_tokens)
    layout = PageLayout.split(kernel_tokens, head_dim)
    page_ids = [17, 3, 29, 8, 11, 0, 36, 21][: (offset + tokens + page_tokens - 1) // page_tokens]
    span = PagedSpan(tuple(page_ids), offset, tokens)
    block = torch.randn(layers, 2, heads, tokens, head_dim).to(torch.bfloat16)
    base = [torch.randn(kernel_pages, heads, kernel_tokens, 2 * head_dim).to(torch.bfloat16) for _ in range(layers)]
    caches = {}
    for name, write in (("layout", None), ("op", split_cache_write)):
        caches[name] = [c.clone() for c in base]
        PagedKV(caches[name], layout, heads, page_tokens, write=write).scatter(block, span)
    assert all(torch.equal(a, b) for a, b in zip(caches["layout"], caches["op"]))
    assert not all(torch.equal(a, b) for a, b in zip(caches["op"], base))
    paged = PagedKV(caches["op"], layout, heads, page_tokens)
    pages, local = paged.copy_pages(span)
    assert pages.shape == (layers, len(page_ids) * (page_tokens // kernel_tokens), heads, kernel_tokens, 2 * head_dim)
    assert torch.equal(paged.block_of_pages(pages, local), block)


def test_vllm_cpu_write_op_scatter_is_bit_identical_to_the_layout_path():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from engine_adapter.vllm.layout import cpu_cache_write

    heads, page_tokens, head_dim, layers = 3, 128, 64, 2
    isa = _get_attn_isa(torch.bfloat16, page_tokens, head_dim)
    write = cpu_cache_write(isa)
    layout = measure_page_layout(write, heads, page_tokens, head_dim, torch.bfloat16)
    block = torch.randn(layers, 2, heads, 300, head_dim).to(torch.bfloat16)
    span = PagedSpan((5, 1, 3), 50, 300)
    ours = [torch.zeros(6, heads, page_tokens, 2 * head_dim, dtype=torch.bfloat16) for _ in range(layers)]
    theirs = [c.clone() for c in ours]
    PagedKV(ours, layout, heads, page_tokens).scatter(block, span)
    PagedKV(theirs, layout, heads, page_tokens, write=write).scatter(block, span)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), isa
    # the connector's CPU path: kvstore's native page writer, where it knows the measured layout
    if isa in ("vec", "vec16"):  # AVX2 / AVX-512 without AMX: keys transposed within the page
        assert layout.name() == "kt_halves"
    if isa == "amx":  # AMX: VNNI pairs (dims of K, rows of V)
        assert layout.name() == "amx"
    if layout.name() is not None:
        native = [torch.zeros_like(c) for c in ours]
        PagedKV(native, layout, heads, page_tokens, native=PageWriter(native, layout.name())).scatter(block, span)
        assert all(torch.equal(a, b) for a, b in zip(native, theirs)), isa


@pytest.mark.parametrize("isa,name,page_tokens,head_dim,dtype", [
    ("vec", "kt_halves", 128, 64, torch.bfloat16), ("vec16", "kt_halves", 16, 64, torch.bfloat16),
    ("vec16", "kt_halves", 16, 80, torch.bfloat16),   # a head size not a multiple of 32: vLLM picks vec16
    ("vec16", "kt_halves", 128, 48, torch.bfloat16),
    ("vec", "kt_halves", 128, 64, torch.float16), ("vec", "kt_halves", 64, 256, torch.float32),
    ("amx", "amx", 128, 64, torch.bfloat16), ("amx", "amx", 32, 128, torch.bfloat16),
    ("amx", "amx", 64, 256, torch.bfloat16),
    ("amx", "kt_halves", 32, 80, torch.bfloat16),     # vLLM's amx op keeps vec's layout for such a head
])
@pytest.mark.parametrize("simd", [True, False])
def test_every_cpu_isa_layout_is_one_the_native_writer_knows(isa, name, page_tokens, head_dim, dtype, simd):
    """Whatever ISA this host picks, each CPU_ATTN page layout is measured from vLLM's own op and
    named, so the connector writes it natively on any host (vLLM's ops write every ISA's layout on
    any x86 host: the layout is memory, not instructions); the writer, with its AVX2 paths and
    without, matches the op bit for bit on a piece starting mid-page, whole pages and a ragged end."""
    from engine_adapter.vllm.layout import cpu_cache_write

    write = cpu_cache_write(isa)
    try:
        layout = measure_page_layout(write, 2, page_tokens, head_dim, dtype)
    except RuntimeError as exc:  # an ISA this vLLM build cannot run here
        pytest.skip(f"vLLM's cache-write op for ISA {isa} does not run here: {exc}")
    assert layout.name() == name
    block = torch.randn(2, 2, 2, 2 * page_tokens + 7, head_dim).to(dtype)
    span = PagedSpan((4, 0, 2), 5, 2 * page_tokens + 7)
    ours = [torch.randn(5, 2, page_tokens, 2 * head_dim).to(dtype) for _ in range(2)]
    theirs = [c.clone() for c in ours]
    PagedKV(ours, layout, 2, page_tokens, native=PageWriter(ours, name, simd=simd)).scatter(block, span)
    PagedKV(theirs, layout, 2, page_tokens, write=write).scatter(block, span)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_paged_span_of_a_token_range():
    span = PagedSpan.of([7, 2, 9, 4, 1], page_tokens=64, start=100, end=320)  # pages 1..4
    assert span == PagedSpan((2, 9, 4, 1), 36, 220)
    with pytest.raises(ValueError, match="pages"):
        PagedSpan.of([7, 2], page_tokens=64, start=0, end=256)


def planner(page_tokens: int = 128, tails: bool = True) -> Planner:
    return Planner(Namespace("m", KVLayout(2, 1, 4, "bfloat16")), page_tokens, tails=tails)


def test_plan_loads_the_hit_beyond_vllms_own_and_never_the_last_token():
    plan = planner(page_tokens=128)
    prompt = list(range(1000, 1000 + 3 * CHUNK + 1))  # 3 full chunks before the last token
    assert len(plan.keys_of("r", prompt)) == 3
    prompt_ending_on_a_chunk = list(range(3 * CHUNK))  # the last token is computed: 2 chunks and a 128-token tail
    assert len(plan.keys_of("s", prompt_ending_on_a_chunk)) == 3 and plan.requests["s"].tail == 128
    assert len(planner(page_tokens=128, tails=False).keys_of("s", prompt_ending_on_a_chunk)) == 2
    # vLLM's own cache holds 384 tokens (3 pages); kvstore holds 3 chunks: load 384..767
    assert plan.loadable("r", 3, 384) == 768 - 384 and plan.requests["r"].hit_tokens == 0  # asks, remembers nothing
    assert plan.record_hit("r", hit_chunks=3, computed_tokens=384, tiers=("cpu", "cpu", "disk")) == 768 - 384
    assert plan.hit_sources("r", 768 - 384) == {"cpu": 128, "disk": 256}
    page_ids = [5, 6, 7, 8, 9, 10, 11]
    plan.plan_load("r", page_ids, 768 - 384)
    step = plan.plan_step([("r", 768, 1)], lambda rid: page_ids)
    loads = step.loads["r"]
    assert [(c.lo, c.hi) for c in loads] == [(128, 256), (0, 256)]
    assert loads[0].span == PagedSpan((8,), 0, 128) and loads[1].span == PagedSpan((9, 10), 0, 256)
    assert step.saves == []  # kvstore has every chunk
    assert not plan.plan_step([("r", 769, 1)], lambda rid: page_ids)  # loads are handed out once


def test_plan_saves_each_chunk_once_when_completed():
    plan = planner(page_tokens=128)
    prompt = list(range(2 * CHUNK + 50))
    plan.keys_of("r", prompt)
    assert plan.record_hit("r", hit_chunks=0, computed_tokens=0) == 0
    pages = list(range(20, 25))
    asked = []

    def page_ids_of(rid):
        asked.append(rid)
        return pages

    step = plan.plan_step([("r", 0, 300)], page_ids_of)  # chunked prefill: 300 tokens, then the rest
    assert [s.span for s in step.saves] == [PagedSpan((20, 21), 0, 256)]
    step = plan.plan_step([("r", 300, 2 * CHUNK + 50 - 300)], page_ids_of)
    assert [s.span for s in step.saves] == [PagedSpan((22, 23), 0, 256)]
    assert not plan.plan_step([("r", 2 * CHUNK + 50, 1)], page_ids_of)  # decode saves nothing
    assert asked == ["r", "r"]
    plan.forget("r")
    assert plan.requests == {}


def test_plan_saves_vllm_hits_that_kvstore_lacks():
    plan = planner(page_tokens=128)
    plan.keys_of("r", list(range(3 * CHUNK + 10)))
    plan.record_hit("r", hit_chunks=1, computed_tokens=640)  # vLLM's own 640 beat kvstore's 256
    step = plan.plan_step([("r", 640, 3 * CHUNK + 10 - 640)], lambda rid: list(range(7)))
    assert [s.key for s in step.saves] == plan.requests["r"].keys[1:3]


@pytest.mark.parametrize("page_tokens", [16, 96, 128])
@pytest.mark.parametrize("prompt_tokens", [1, 2, 15, 16, 17, 127, 128, 129, 255, 256, 257, 600, 1000])
def test_plan_hits_reach_the_last_page_boundary(page_tokens, prompt_tokens):
    """Full chunks, then a tail up to the last page boundary before the last token; each piece saved once."""
    plan = planner(page_tokens=page_tokens)
    keys = plan.keys_of("r", list(range(7, 7 + prompt_tokens)))
    covered = (prompt_tokens - 1) // page_tokens * page_tokens  # the last page boundary before the last token
    full = (prompt_tokens - 1) // CHUNK
    assert len(keys) == full + (covered > full * CHUNK)
    assert len(set(keys)) == len(keys)
    # a stored prompt is a hit up to that boundary (at least its full chunks)
    assert plan.record_hit("r", hit_chunks=len(keys), computed_tokens=0) == max(covered, full * CHUNK)
    pages = list(range(100, 100 + (prompt_tokens + page_tokens - 1) // page_tokens))
    if covered:
        assert plan.plan_load("r", pages, max(covered, full * CHUNK)) == keys
    step = plan.plan_step([("r", max(covered, full * CHUNK), prompt_tokens)], lambda rid: pages)
    assert sum(load.hi - load.lo for load in step.loads.get("r", [])) == max(covered, full * CHUNK)
    assert step.saves == []  # kvstore had every piece
    # a cold prompt saves every piece exactly once, each with its own length
    cold = planner(page_tokens=page_tokens)
    cold.keys_of("r", list(range(7, 7 + prompt_tokens)))
    cold.record_hit("r", 0, 0)
    saves = cold.plan_step([("r", 0, prompt_tokens)], lambda rid: pages).saves
    assert [s.key for s in saves] == keys
    assert sum(s.span.tokens for s in saves) == max(covered, full * CHUNK)
    assert not cold.plan_step([("r", prompt_tokens, 1)], lambda rid: pages)


def test_plan_tail_keys_are_shared_by_equal_page_sizes_and_never_equal_a_chunk_key():
    a, b = planner(page_tokens=128), planner(page_tokens=128)
    prompt = list(range(3, 3 + CHUNK + 200))
    assert a.keys_of("x", prompt) == b.keys_of("y", prompt + [5, 6, 7])  # same pieces up to the page boundary
    other = planner(page_tokens=64).keys_of("z", prompt)
    assert other[0] == a.requests["x"].keys[0] and other[1] != a.requests["x"].keys[1]  # chunk shared, tail not
    assert prefix_keys(a.namespace, prompt)[0] == a.requests["x"].keys[0]


def test_plan_of_a_consumer_loads_and_never_saves():
    plan = Planner(Namespace("m", KVLayout(2, 1, 4, "bfloat16")), 128, saves=False)
    plan.keys_of("r", list(range(3 * CHUNK + 10)))
    assert plan.record_hit("r", hit_chunks=1, computed_tokens=0) == CHUNK
    plan.plan_load("r", list(range(7)), CHUNK)
    step = plan.plan_step([("r", 0, 3 * CHUNK + 10)], lambda rid: list(range(7)))
    assert len(step.loads["r"]) == 1 and step.saves == []


def test_plan_lost_load_is_saved_after_recompute():
    plan = planner(page_tokens=128)
    prompt = list(range(3 * CHUNK + 10))
    keys = plan.keys_of("r", prompt)
    plan.record_hit("r", hit_chunks=3, computed_tokens=0)
    plan.plan_load("r", list(range(7)), 3 * CHUNK)
    plan.plan_step([("r", 3 * CHUNK, 11)], lambda rid: list(range(7)))
    plan.lost("r", 256)  # only chunk 0 arrived: vLLM recomputes from token 256
    step = plan.plan_step([("r", 256, 3 * CHUNK + 10 - 256)], lambda rid: list(range(7)))
    assert [s.key for s in step.saves] == keys[1:3]


def test_connector_settings_are_validated():
    from engine_adapter.vllm.settings import ConnectorSettings

    settings = ConnectorSettings.from_extra_config({"address": "unix:/x.sock", "chunk_tokens": "128"})
    assert settings.address == "unix:/x.sock" and settings.chunk_tokens == 128
    with pytest.raises(ValueError, match="unknown .* \\['adress'\\]"):
        ConnectorSettings.from_extra_config({"adress": "unix:/x.sock"})
    with pytest.raises(ValueError, match="must be positive"):
        ConnectorSettings.from_extra_config({"chunk_tokens": 0})
    assert ConnectorSettings.from_extra_config({"tail_blocks": "false"}).tail_blocks is False
    with pytest.raises(ValueError, match="save_mode.*one of"):
        ConnectorSettings.from_extra_config({"save_mode": "later"})
    with pytest.raises(ValueError, match="tail_blocks.*must be a bool"):
        ConnectorSettings.from_extra_config({"tail_blocks": "maybe"})


def rows_reference(q, keys, values, rows):
    """float64 row-exact attention [H, R, D]: row i (position rows[i]) reads keys 0 .. rows[i]."""
    heads, kv_heads = q.shape[0], keys.shape[0]
    k = keys.double().repeat_interleave(heads // kv_heads, 0)
    v = values.double().repeat_interleave(heads // kv_heads, 0)
    scores = q.double() @ k.transpose(1, 2) / q.shape[-1] ** 0.5  # [H, R, S]
    hidden = torch.arange(keys.shape[1])[None, :] > rows[:, None]
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v


def scattered_rows(total: int, generator: torch.Generator) -> torch.Tensor:
    """Sorted positions as a blend selects them: runs (a chunk's first tokens), pairs and lone rows,
    position 0 and the last position included."""
    picked = torch.rand(total, generator=generator) < 0.15
    start = int(torch.randint(0, max(1, total - 16), (1,), generator=generator))
    picked[start:start + 16] = True
    picked[0] = picked[total - 1] = True
    return torch.nonzero(picked).flatten()


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])  # measured 1.2e-6, 3.0e-3
@pytest.mark.parametrize("total, block", [(37, 32), (300, 128), (1000, 64)])
def test_the_blends_rows_on_vllms_cpu_attention_kernel_match_a_float64_reference(monkeypatch, dtype, bound, total,
                                                                                    block):
    """`PagedRows` (the blend's row-exact attention on vLLM's CPU kernel, each run of positions a
    request over one scratch cache) against float64, on random irregular rows; the SDPA calls it
    replaces within the same bound. A cache with room past the prompt, GQA, runs split over calls."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from blend.recompute import SdpaRows
    from engine_adapter.vllm import row_attention

    monkeypatch.setattr(row_attention, "REQUESTS_PER_CALL", 2)  # several kernel calls per layer
    generator = torch.Generator().manual_seed(total + block)
    heads, kv_heads, head_dim, capacity = 6, 2, 64, total + 23
    attention = SimpleNamespace(isa=_get_attn_isa(dtype, block, head_dim), impl=SimpleNamespace(scale=head_dim ** -0.5),
                                kv_cache=torch.empty(1, kv_heads, block, 2 * head_dim, dtype=dtype))
    rows = scattered_rows(total, generator)
    paged = row_attention.PagedRows(attention, rows, total, heads, kv_heads, head_dim, dtype)
    sdpa = SdpaRows(rows, dtype)
    assert len(paged.calls) > 1
    for layer in range(2):  # the scratch cache is refilled per layer
        keys, values = (torch.randn(kv_heads, capacity, head_dim, generator=generator).to(dtype) for _ in range(2))
        keys[:, total:] = float("nan")  # past the prompt: never read
        q = (torch.randn(heads, rows.numel(), head_dim, generator=generator) * 2).to(dtype)
        want = rows_reference(q, keys[:, :total], values[:, :total], rows)
        for name, got in (("vllm", paged(layer, q, keys, values)), ("sdpa", sdpa(layer, q, keys, values))):
            assert got.shape == want.shape
            error = float((got.double() - want).abs().max() / want.abs().max())
            assert error < bound, (name, dtype, total, block, error)
    none = row_attention.PagedRows(attention, rows[:0], total, heads, kv_heads, head_dim, dtype)
    assert none(0, q[:, :0], keys, values).shape == (heads, 0, head_dim)


def test_only_a_plain_cpu_attention_layer_lends_its_kernel_to_the_blend():
    from engine_adapter.vllm.row_attention import NO_ISA_YET, row_attention_problem

    class CPUAttentionBackendImpl:  # the name the check reads
        def __init__(self, **changes):
            self.scale, self.alibi_slopes, self.sliding_window, self.logits_soft_cap = 0.125, None, -1, 0
            self.sinks, self.kv_cache_dtype = None, "auto"
            self.__dict__.update(changes)

    def layer(impl, isa="vec", cache=None):
        return SimpleNamespace(impl=impl, isa=isa, kv_cache=torch.empty(2, 3, 32, 128) if cache is None else cache)

    assert row_attention_problem(layer(CPUAttentionBackendImpl()), 64) is None
    assert "backend" in row_attention_problem(layer(SimpleNamespace()), 64)
    assert row_attention_problem(layer(CPUAttentionBackendImpl(), isa=None), 64) == NO_ISA_YET
    for change in ({"sliding_window": 128}, {"alibi_slopes": torch.ones(3)}, {"logits_soft_cap": 30.0},
                   {"sinks": torch.ones(3)}, {"kv_cache_dtype": "fp8"}):
        assert "sliding window" in row_attention_problem(layer(CPUAttentionBackendImpl(**change)), 64), change
    assert "scale 0.1 is not 1/sqrt(64)" in row_attention_problem(layer(CPUAttentionBackendImpl(scale=0.1)), 64)
    assert "paged KV cache" in row_attention_problem(layer(CPUAttentionBackendImpl(), cache=[]), 64)
    assert "paged KV cache" in row_attention_problem(layer(CPUAttentionBackendImpl(scale=1 / 16)), 256)  # heads of 64
