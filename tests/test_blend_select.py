"""CacheBlend's selectors (blend/select.py): each picks the tokens the recompute should, against a
direct computation on tiny random models; the query pass and its row blocks; the registry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from blend.assemble import BlendLayout
from blend.recompute import blend_prefill
from blend.select import DEFAULT_SELECTOR, SELECTORS, get_selector, top_positions
from tests.blend_models import TOL, assembled, full_logits, naive_reuse, tiny_model, tiny_prompt


def test_top_positions_and_registry():
    assert top_positions(torch.tensor([0.1, 5.0, 3.0, 5.0]), torch.tensor([10, 11, 12, 13]), 2).tolist() == [11, 13]
    assert top_positions(torch.tensor([1.0]), torch.tensor([4]), 0).numel() == 0
    with pytest.raises(ValueError, match="known"):
        get_selector("nope")


def test_sinks_take_the_first_tokens_of_each_chunk_in_proportion():
    layout = BlendLayout.from_lengths(2, [10, 30], 1)  # chunks at 2..11 and 12..41
    picked = get_selector("sinks").select(layout, None, budget=8).tolist()
    assert picked == [2, 3, 12, 13, 14, 15, 16, 17]


def test_lead_attn_deviation_takes_leading_tokens_then_follows_attention_deviation():
    layout = BlendLayout.from_lengths(2, [40, 10, 30], 1)  # chunks at 2..41, 42..51, 52..81
    scores = torch.zeros(80)
    scores[[30, 31, 39, 75]] = torch.tensor([4.0, 1.0, 3.0, 2.0])  # chunk positions 32, 33, 41, 77
    scores[[0, 45]] = 9.0  # positions 2 and 47: leading tokens anyway, must not be counted twice
    view = SimpleNamespace(attention_deviation=scores, device=scores.device)
    selector = get_selector("lead_attn_deviation")
    assert selector.check_layer == 1
    picked = selector.select(layout, view, budget=16 + 10 + 16 + 3).tolist()
    leading = list(range(2, 18)) + list(range(42, 52)) + list(range(52, 68))  # 16, all 10, 16
    assert picked == sorted(leading + [32, 41, 77])
    # a budget that cannot cover the quota goes to leading tokens only, split by length like sinks
    assert selector.select(layout, view, budget=20).tolist() == get_selector("sinks").select(layout, None, 20).tolist()
    assert selector.select(layout, view, budget=0).numel() == 0


def test_stale_attention_takes_leading_tokens_then_what_the_query_reads():
    layout = BlendLayout.from_lengths(2, [40, 10, 30], 1)  # chunks at 2..41, 42..51, 52..81
    attention = torch.zeros(4, 80)  # [layers, chunk tokens]
    attention[0, 31] = 50.0  # position 33, read on layer 0 only: layers before first_layer do not count
    attention[2, [30, 39]] = torch.tensor([4.0, 1.0])  # positions 32 and 41
    attention[3, [39, 75]] = torch.tensor([2.5, 2.0])  # 41 again (3.5 in all) and 77
    attention[2:, [0, 45]] = 9.0  # positions 2 and 47: leading tokens anyway, must not be counted twice
    view = SimpleNamespace(attention=attention, device=attention.device)
    selector = get_selector("stale_attention")
    assert selector.name == DEFAULT_SELECTOR and selector.check_layer is None and selector.query_pass
    leading = list(range(2, 18)) + list(range(42, 52)) + list(range(52, 68))  # 16, all 10, 16
    assert selector.select(layout, view, budget=16 + 10 + 16 + 2).tolist() == sorted(leading + [32, 41])
    assert selector.select(layout, view, budget=16 + 10 + 16 + 3).tolist() == sorted(leading + [32, 41, 77])
    assert SELECTORS["stale_attention"](first_layer=0).select(layout, view, 16 + 10 + 16 + 1).tolist() == sorted(
        leading + [33])
    # a budget that cannot cover the quota goes to leading tokens only, split by length like sinks
    assert selector.select(layout, view, budget=20).tolist() == get_selector("sinks").select(layout, None, 20).tolist()
    assert selector.select(layout, view, budget=0).numel() == 0


def test_stale_query_attention_is_what_naive_reuse_computes():
    # The query pass is the query of naive reuse: the same K/V for the query rows on every layer,
    # and on each layer the query's attention spread over the prompt (H heads x Q rows of mass).
    from blend.recompute import stale_query_attention

    model = tiny_model()
    prefix, chunks, query = tiny_prompt()
    layout = BlendLayout.from_lengths(len(prefix), [len(c) for c in chunks], len(query))
    naive, _ = naive_reuse(model, layout, prefix, chunks, query)
    kv = assembled(model, layout, [prefix] + chunks)
    cos, sin = model.rope(torch.arange(layout.total))
    mass = stale_query_attention(model, kv, layout, torch.tensor(prefix + sum(chunks, []) + query), cos, sin)
    assert mass.shape == (4, layout.chunk_positions.numel())
    kv.length = layout.total
    assert (kv.export(0, layout.total) - naive.export(0, layout.total)).abs().max() <= TOL
    heads_x_rows = model.config.num_heads * len(query)
    assert bool((mass >= 0).all()) and bool((mass.sum(1) < heads_x_rows).all()) and bool((mass.sum(1) > 0.1).all())
    # and the blend's accounting counts the pass: query rows on every layer, before the main pass
    kv = assembled(model, layout, [prefix] + chunks)
    out = blend_prefill(model, kv, layout, torch.tensor(prefix + sum(chunks, []) + query),
                        get_selector("stale_attention"), 0.2)
    assert out.query_pass_rows == len(query) and out.token_layers == sum(out.rows_per_layer) + 4 * len(query)


def reference_stale_mass(model, layout, parts, ids, layers):
    """[layers, N] the query's attention mass on each chunk token per layer, computed directly in
    float64: the query rows through layers 0 .. layers-1 of a float64 copy of ``model`` over the
    assembled (stale) cache, keys repeated per head, one softmax per row (no grouping, no blocks)."""
    import copy

    wide = copy.deepcopy(model).double()
    stale = assembled(model, layout, parts)
    rows = layout.query_positions
    cos, sin = (t.double() for t in wide.rope(torch.arange(layout.total)))
    chunk_pos = layout.chunk_positions
    mass = []
    with torch.inference_mode():
        h = wide.embed(torch.tensor(ids)[rows])
        for layer in wide.layers[:layers]:
            q, k, v = layer.qkv(h, cos[rows], sin[rows])  # [H, R, D], [KVH, R, D] x 2
            keys, values = (t[:, :layout.total].double().clone() for t in stale.read(layer.index, layout.total))
            keys[:, rows], values[:, rows] = k, v
            group = q.shape[0] // keys.shape[0]
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H, T, D]
            scores = q @ keys.transpose(1, 2) / q.shape[-1] ** 0.5  # [H, R, T]
            scores[:, torch.arange(layout.total)[None, :] > rows[:, None]] = float("-inf")
            probs = scores.softmax(-1)
            mass.append(probs.sum((0, 1))[chunk_pos])
            h = h + layer.output(probs @ values)
            h = h + layer.feed_forward(h)
    return torch.stack(mass)


@pytest.mark.parametrize("pass_layers", [1, 3, 5])
def test_a_shallow_query_pass_scores_what_a_direct_computation_does(pass_layers):
    # The query pass cut after ``pass_layers`` layers: its mass is the direct float64 computation's
    # (and the first layers of the whole pass), and the selector picks the rows that computation picks.
    from blend.recompute import stale_query_attention
    from blend.select import StaleAttentionSelector

    model = tiny_model(layers=5)
    prefix, chunks, query = tiny_prompt(prefix=4, chunks=(19, 7, 26), query=9)
    ids = prefix + sum(chunks, []) + query
    layout = BlendLayout.from_lengths(len(prefix), [len(c) for c in chunks], len(query))
    cos, sin = model.rope(torch.arange(layout.total))
    expected = reference_stale_mass(model, layout, [prefix] + chunks, ids, pass_layers)
    with torch.inference_mode():
        mass = stale_query_attention(model, assembled(model, layout, [prefix] + chunks), layout, torch.tensor(ids),
                                     cos, sin, layers=pass_layers)
        whole = stale_query_attention(model, assembled(model, layout, [prefix] + chunks), layout, torch.tensor(ids),
                                      cos, sin)
    assert mass.shape == (pass_layers, layout.chunk_positions.numel()) and float(expected.sum()) > 1
    assert (mass.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(mass, whole[:pass_layers])
    # the selection: 2 leading tokens of every chunk, then the top of layers first_layer .. pass_layers-1
    first = min(1, pass_layers - 1)
    selector = StaleAttentionSelector(lead=2, first_layer=first, pass_layers=pass_layers)
    budget = 14
    score = expected[first:].sum(0)
    forced = [c.start + i for c in layout.chunks for i in range(2)]
    positions = layout.chunk_positions.tolist()
    rest = sorted((p for p in positions if p not in forced), key=lambda p: -float(score[positions.index(p)]))
    want = sorted(forced + rest[: budget - len(forced)])
    out = blend_prefill(model, assembled(model, layout, [prefix] + chunks), layout, torch.tensor(ids), selector,
                        budget / layout.chunk_positions.numel())
    assert out.selected.tolist() == want
    assert out.query_pass_layers == pass_layers and out.query_pass_rows == len(query)
    assert out.token_layers == sum(out.rows_per_layer) + pass_layers * len(query)


@pytest.mark.parametrize("kv_only", [False, True])
def test_a_shallow_query_pass_keeps_ratio_one_exact(kv_only):
    # The pass writes the query's K/V on its layers only; whatever it leaves above them, the main
    # pass computes every row the prompt's answer reads: r = 1 is the full prefill.
    from blend.select import StaleAttentionSelector

    model = tiny_model(layers=5)
    prefix, chunks, query = tiny_prompt(prefix=4, chunks=(19, 7, 26), query=9)
    ids = prefix + sum(chunks, []) + query
    layout = BlendLayout.from_lengths(len(prefix), [len(c) for c in chunks], len(query))
    expected, exact_kv = full_logits(model, ids)
    end = len(ids) if not kv_only else layout.query.start
    kv = assembled(model, layout, [prefix] + chunks)
    out = blend_prefill(model, kv, layout, torch.tensor(ids), StaleAttentionSelector(first_layer=1, pass_layers=2), 1.0,
                        kv_only=kv_only)
    assert (kv.export(0, end) - exact_kv.export(0, end)).abs().max() <= TOL
    if not kv_only:
        assert (out.logits - expected).abs().max() <= TOL
    with pytest.raises(ValueError, match="pass_layers"):
        StaleAttentionSelector(first_layer=2, pass_layers=2)


def test_attention_in_row_blocks_is_the_same_as_at_once(monkeypatch):
    """A long query's attention is formed a block of rows at a time (memory bounded for any
    prompt): one row per block gives the same mass, KV, selections and logits as all rows at once."""
    import blend.select
    from blend.recompute import stale_query_attention
    from blend.select import CheckLayerView, row_blocks

    assert [(b.start, b.stop) for b in row_blocks(10, 2, 8, block_bytes=4 * 2 * 8 * 3)] == [
        (0, 3), (3, 6), (6, 9), (9, 10)]
    assert len(row_blocks(5, 9, 10 ** 9, block_bytes=1)) == 5 and row_blocks(0, 2, 8) == []
    model = tiny_model()
    prefix, chunks, query = tiny_prompt(query=11)
    layout = BlendLayout.from_lengths(len(prefix), [len(c) for c in chunks], len(query))
    ids = torch.tensor(prefix + sum(chunks, []) + query)
    cos, sin = model.rope(torch.arange(layout.total))

    def run():
        kv = assembled(model, layout, [prefix] + chunks)
        with torch.inference_mode():
            mass = stale_query_attention(model, kv, layout, ids, cos, sin)
        kv.length = layout.total
        blended = assembled(model, layout, [prefix] + chunks)
        out = blend_prefill(model, blended, layout, ids, get_selector("stale_attention"), 0.3)
        gen = torch.Generator().manual_seed(3)
        q, k = torch.randn(4, layout.total, 8, generator=gen), torch.randn(2, layout.total, 8, generator=gen)
        view = CheckLayerView(layout=layout, fresh_q=q, fresh_k=k, fresh_v=k, cached_k=k, cached_v=k)
        return mass, kv.export(0, layout.total), out, view.query_attention

    mass, kv, out, attention = run()
    monkeypatch.setattr(blend.select, "ATTENTION_BLOCK_BYTES", 1)  # one row per block
    mass1, kv1, out1, attention1 = run()
    assert (mass1 - mass).abs().max() <= 1e-5 and (kv1 - kv).abs().max() <= 1e-5
    assert (attention1 - attention).abs().max() <= 1e-5 and float(attention.sum()) > 1
    assert out1.selected.tolist() == out.selected.tolist() and (out1.logits - out.logits).abs().max() <= 1e-4


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_selectors_keep_the_scores_device(name):
    """On a GPU the check layer's tensors live on the device while layout positions are built on the
    CPU: every selection must come back on the scores' device (CI has no second device: the meta
    device stands in, and a CPU tensor mixed in would show in the result's device)."""
    from blend.select import CheckLayerView, StaleReadView

    layout = BlendLayout.from_lengths(3, [20, 7, 13], 4)
    gen = torch.Generator().manual_seed(5)
    kvh, heads, d, total = 2, 4, 8, layout.total

    def on_meta(*shape):
        return torch.randn(*shape, generator=gen).to("meta")

    view = CheckLayerView(layout, on_meta(heads, total, d), on_meta(kvh, total, d), on_meta(kvh, total, d),
                          on_meta(kvh, total, d), on_meta(kvh, total, d))
    selector = get_selector(name)
    if selector.query_pass:
        view = StaleReadView(layout, on_meta(3, layout.chunk_positions.numel()))
    picked = selector.select(layout, view if selector.check_layer is not None or selector.query_pass else None,
                             budget=9)
    if selector.check_layer is not None or selector.query_pass:
        assert picked.device.type == "meta"
    if selector.wants_refine(1):
        kept = layout.chunk_positions[:12].to("meta")
        assert selector.refine(1, kept, on_meta(12), budget=9).device.type == "meta"


def test_gradual_filter_narrows_to_the_budget():
    model = tiny_model(layers=6)
    prefix, chunks, query = tiny_prompt(chunks=(40, 40))
    layout = BlendLayout.from_lengths(len(prefix), [40, 40], len(query))
    kv = assembled(model, layout, [prefix] + chunks)
    out = blend_prefill(model, kv, layout, torch.tensor(prefix + sum(chunks, []) + query), get_selector("gradual"), 0.1)
    counts = [r - len(query) for r in out.rows_per_layer]
    # layer 0 full; check layer keeps 2 x 8; then 13, 11, 8 and 8 to the end
    assert counts[0] == layout.total - len(query) and counts[1] == 16
    assert counts[2:] == [13, 11, 8, 8] and out.selected.numel() == 8


def test_query_aware_prefers_what_the_query_reads():
    model = tiny_model()
    prefix, chunks, query = tiny_prompt()
    layout = BlendLayout.from_lengths(len(prefix), [len(c) for c in chunks], len(query))
    kv = assembled(model, layout, [prefix] + chunks)
    out = blend_prefill(model, kv, layout, torch.tensor(prefix + sum(chunks, []) + query),
                        get_selector("query_aware"), 0.2)
    assert out.selected.numel() == round(0.2 * 49)
    assert set(out.selected.tolist()) <= set(layout.chunk_positions.tolist())
