"""kernels/query_probs.c: the query pass's attention probabilities and mass against
`blend.select.attention_probs` (the torch path, its reference) on random irregular shapes."""

from __future__ import annotations

import pytest
import torch

from blend.select import attention_probs
from kernels.query_probs import query_probs


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    kv_heads, group = draw(1, 4), draw(1, 4)
    dim = (2, 8, 14, 64, 66, 128)[draw(0, 6)]
    keys_n, rows = draw(1, 300), draw(1, 23)
    # keys a view of a longer cache, as `KVCache.read` gives them; magnitudes of real scores
    cache = (torch.randn(kv_heads, keys_n + draw(0, 40), dim, generator=g) * 2).bfloat16()
    q = (torch.randn(kv_heads * group, rows, dim, generator=g) * 3).bfloat16()
    positions = torch.sort(torch.randint(0, keys_n + 5, (rows,), generator=g)).values  # some past the last key
    weights = (torch.rand(rows, generator=g) > 0.3).float()
    return q, cache[:, :keys_n], positions, weights


def _needs_kernel(result):
    if result is None:
        pytest.skip("no AVX512-BF16 (or no C compiler) here: the query pass keeps its torch path")
    return result


@pytest.mark.parametrize("seed", range(40))
def test_query_probs_is_attention_probs(seed):
    """Probabilities within 1e-5 relative (+1e-7) of torch's float32 path, 0 past each row's
    position; the mass within 1e-5 of the weighted sum of torch's probabilities."""
    q, keys, positions, weights = _case(seed)
    probs, mass = _needs_kernel(query_probs(q, keys, positions, weights))
    reference = attention_probs(q, keys, positions)
    assert probs.shape == reference.shape and probs.dtype == torch.float32
    assert float(((probs - reference).abs() - 1e-5 * reference).max()) <= 1e-7
    visible = torch.arange(keys.shape[1])[None, :] <= positions[:, None]  # [R, S]
    assert bool((probs[:, ~visible] == 0).all())
    assert (probs.sum(-1) - 1).abs().max() <= 1e-5
    expected = (reference * weights[None, :, None]).sum((0, 1))
    assert float((mass - expected).abs().max()) <= 1e-5 * max(float(expected.abs().max()), 1e-30)
    unweighted = _needs_kernel(query_probs(q, keys, positions))[1]
    assert float((unweighted - reference.sum((0, 1))).abs().max()) <= 1e-5 * float(reference.sum((0, 1)).max())


def test_query_probs_leaves_what_it_does_not_take_to_torch():
    """None (the caller's torch path) for other dtypes, shapes it does not take, and a row that
    would see no key."""
    q, keys, positions, _ = _case(3)
    _needs_kernel(query_probs(q, keys, positions))
    assert query_probs(q.float(), keys.float(), positions) is None
    assert query_probs(q.half(), keys.half(), positions) is None
    assert query_probs(q, keys[..., :-2], positions) is None  # head dims differ
    assert query_probs(q, keys.transpose(1, 2).contiguous().transpose(1, 2), positions) is None  # dims not contiguous
    assert query_probs(q[:, :0], keys, positions[:0]) is None and query_probs(q, keys[:, :0], positions) is None
    assert query_probs(q, keys, positions - positions.max() - 1) is None  # sees no key
    assert query_probs(q, keys, positions[:-1]) is None and query_probs(q, keys, positions, torch.ones(1)) is None
    assert query_probs(q[0], keys, positions) is None  # not [H, R, D]


def test_query_probs_passes_nan_on_as_torch_does():
    """A NaN key (a corrupt activation) makes NaN the rows that see it, as torch's softmax does,
    not finite probabilities that would hide it; rows that do not see it are unaffected."""
    q, keys, positions, _ = _case(7)
    keys = keys.clone()
    keys[:, 0, 0] = float("nan")
    probs, mass = _needs_kernel(query_probs(q, keys, positions))
    reference = attention_probs(q, keys, positions)
    assert torch.equal(probs.isnan(), reference.isnan()) and bool(probs.isnan().any()) and bool(mass.isnan().any())
    three_heads = torch.randn(3, 4, 8).bfloat16()
    assert query_probs(three_heads, torch.randn(2, 5, 8).bfloat16(), torch.arange(4)) is None  # 3 heads, 2 KV heads


def test_the_query_pass_on_the_kernel_selects_what_torch_selects(monkeypatch):
    """The query pass of a bfloat16 model through the kernel and through torch: the same mass to
    bfloat16 rounding of the rows' hidden states, the same tokens selected."""
    import blend.recompute
    from blend.assemble import BlendLayout
    from blend.select import StaleReadView, get_selector
    from tests.blend_models import assembled, tiny_model, tiny_prompt

    model = tiny_model(seed=4).to(torch.bfloat16)
    prefix, chunks, query = tiny_prompt(seed=5, chunks=(40, 31, 52), query=9)
    layout = BlendLayout.from_lengths(len(prefix), [len(c) for c in chunks], len(query))
    ids = torch.tensor(prefix + [token for chunk in chunks for token in chunk] + query)
    cos, sin = model.rope(torch.arange(layout.total))

    def query_pass():
        kv = assembled(model, layout, [prefix] + chunks)
        with torch.inference_mode():
            return blend.recompute.stale_query_attention(model, kv, layout, ids, cos, sin)

    calls = []
    real = blend.recompute.query_probs
    monkeypatch.setattr(blend.recompute, "query_probs", lambda *a, **k: calls.append(1) or real(*a, **k))
    on_kernel = query_pass()
    if real(torch.zeros(2, 1, 16, dtype=torch.bfloat16), torch.zeros(1, 3, 16, dtype=torch.bfloat16),
            torch.tensor([0])) is None:
        pytest.skip("no AVX512-BF16 (or no C compiler) here: the query pass keeps its torch path")
    assert len(calls) == len(model.layers)
    monkeypatch.setattr(blend.recompute, "query_probs", lambda *a, **k: None)
    on_torch = query_pass()
    assert float((on_kernel - on_torch).abs().max()) <= 2e-2 * float(on_torch.abs().max())
    budget = round(0.2 * layout.chunk_positions.numel())
    selector = get_selector("stale_attention")
    kernel_picks = selector.select(layout, StaleReadView(layout, on_kernel), budget).tolist()
    torch_picks = selector.select(layout, StaleReadView(layout, on_torch), budget).tolist()
    assert len(set(kernel_picks) ^ set(torch_picks)) <= 2  # a tie at the budget's edge may fall either way
