"""bench/cache_policy.py: replay semantics, prefix-lru's invariant, admission, the Belady bound, TinyLFU
admission and its duel (bench/cache_tiers.py), and bench/cache_trace.py's loader and synthetic generator."""

import json
import random
import sys
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import cache_policy  # noqa: E402
from cache_policy import ADMISSIONS, POLICIES, belady, simulate, working_set_bytes  # noqa: E402
from cache_tiers import FrequencySketch, PrefixTinyLFUDuelTier, PrefixTinyLFUTier, replay_alone  # noqa: E402
from cache_trace import (Block, Request, TraceError, block_key, load_trace, synthetic_trace,  # noqa: E402
                         write_trace)

TOKENS = 256


def chain(*names: str, nbytes: int = 100) -> tuple[Block, ...]:
    blocks, parent = [], None
    for name in names:
        blocks.append(Block(name, parent, TOKENS, nbytes))
        parent = name
    return tuple(blocks)


def tree_trace(seed: int, nodes: int = 60, requests: int = 300) -> list[Request]:
    """Requests for random root-to-node paths of a random block tree: branching everywhere, unlike
    the synthetic QA trace, where chains fork only after the system prompt."""
    rng = random.Random(seed)
    parents: list[int | None] = [None]
    for i in range(1, nodes):
        parents.append(rng.randrange(i) if rng.random() < 0.85 else None)
    keys: list[str] = []
    for i, parent in enumerate(parents):
        keys.append(block_key(None if parent is None else keys[parent], ("node", i)))
    trace = []
    for r in range(requests):
        node: int | None = min(rng.randrange(nodes) for _ in range(2))  # early nodes (near the roots) asked more
        path = []
        while node is not None:
            path.append(node)
            node = parents[node]
        blocks = tuple(Block(keys[n], None if parents[n] is None else keys[parents[n]], TOKENS, 1000)
                       for n in reversed(path))
        trace.append(Request(f"r{r}", blocks))
    return trace


def configurations(capacity: int):
    """(policy, top, lower, admission, write_through) of every replay the CLI runs at one top size."""
    for policy in POLICIES:
        yield policy, capacity, 0, "all", True
        for admission in ADMISSIONS:
            for through in (True, False):
                yield policy, capacity, capacity, admission, through


def children_of(requests: list[Request]) -> dict[str, set[str]]:
    children = defaultdict(set)
    for request in requests:
        for block in request.blocks:
            if block.parent is not None:
                children[block.parent].add(block.key)
    return children


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_belady_is_never_below_any_policy(seed):
    traces = [synthetic_trace(8, 4, context_blocks=3, question_blocks=1, seed=seed, shared_system_blocks=1),
              synthetic_trace(8, 4, context_blocks=2, question_blocks=2, seed=seed, zipf=1.0),
              tree_trace(seed)]
    for requests in traces:
        working_set = working_set_bytes(requests)
        for fraction in (0.1, 0.3, 0.6):
            top = int(fraction * working_set)
            for policy, top, lower, admission, through in configurations(top):
                result = simulate(requests, policy, top, lower, admission, through)
                best = belady(requests, top + lower)
                assert best.hit_tokens >= result.hit_tokens, (policy, fraction, lower, admission, through)
                assert result.total_tokens == best.total_tokens


def test_lru_strands_a_chain_that_prefix_lru_keeps():
    # Room for 3 blocks. A = a0 -> a1 -> a2 is stored, then b0 needs room:
    #   lru         evicts a0, the oldest (A was touched head first): a1, a2 stay as dead weight
    #   prefix-lru  evicts a2, the least recently used leaf: a0, a1 stay, a prefix of A
    # A comes back: lru hits nothing, prefix-lru 2 blocks; Belady keeps A whole (b0 is never asked again).
    requests = [Request("A", chain("a0", "a1", "a2")), Request("B", chain("b0")), Request("A", chain("a0", "a1", "a2"))]
    assert simulate(requests, "lru", 300).hit_tokens == 0
    assert simulate(requests, "prefix-lru", 300).hit_tokens == 2 * TOKENS
    assert belady(requests, 300).hit_tokens == 3 * TOKENS
    # A lower tier of one block: lru demotes a0 there, so A hits whole, a0 from the lower tier.
    with_disk = simulate(requests, "lru", 300, lower_capacity=100, write_through=False)
    assert with_disk.hit_tokens == 3 * TOKENS and with_disk.lower_hit_tokens == TOKENS


@pytest.mark.parametrize("policy", ["prefix-lru", "prefix-tinylfu", "prefix-tinylfu-duel"])
@pytest.mark.parametrize("through", [True, False])
def test_prefix_policies_never_evict_a_block_whose_child_the_tier_holds(policy, through):
    requests = (tree_trace(3) + synthetic_trace(10, 4, context_blocks=3, question_blocks=1, seed=3)
                + synthetic_trace(10, 4, context_blocks=3, question_blocks=1, seed=4, active=2))  # (tinylfu evicts)
    children = children_of(requests)
    working_set = working_set_bytes(requests)
    stranding = []

    def check(tier, victim):
        held = [child for child in children[victim.key] if child in tier]
        if held:
            stranding.append((tier.name, victim.key, held))

    evictions = 0
    for fraction in (0.05, 0.2, 0.5):
        top = int(fraction * working_set)
        result = simulate(requests, policy, top, top, "all", through, on_evict=check, check_integrity=True)
        evictions += result.evictions_top + result.evictions_lower
    assert evictions > 0 and stranding == []
    # The same check catches lru doing it, so it is not vacuous.
    simulate(requests, "lru", int(0.2 * working_set), on_evict=check, check_integrity=True)
    assert stranding


def test_reused_admission_writes_nothing_down_on_a_trace_without_reuse():
    requests = synthetic_trace(12, 3, context_blocks=4, question_blocks=1, seed=0, no_reuse=True)
    assert len({b.key for r in requests for b in r.blocks}) == sum(len(r.blocks) for r in requests)
    top = working_set_bytes(requests) // 4
    for through in (True, False):
        everything = simulate(requests, "lru", top, top, "all", through)
        reused = simulate(requests, "lru", top, top, "reused", through)
        ghost = simulate(requests, "lru", top, top, "ghost", through)
        assert everything.bytes_written_lower > 0
        assert reused.bytes_written_lower == ghost.bytes_written_lower == 0
        assert everything.hit_ratio == reused.hit_ratio == ghost.hit_ratio == 0.0


def test_ghost_admission_forgets_what_neither_tier_could_have_kept():
    # Round-robin over 12 users, each round's chain longer: a user's blocks come back after about
    # the whole working set, more than the ghost's window of top + lower bytes, so ghost admits less.
    requests = synthetic_trace(12, 4, context_blocks=4, question_blocks=1, seed=1)
    top = working_set_bytes(requests) // 8
    reused = simulate(requests, "lru", top, top, "reused")
    ghost = simulate(requests, "lru", top, top, "ghost")
    assert 0 < ghost.bytes_written_lower < reused.bytes_written_lower


@pytest.mark.parametrize("requests", [synthetic_trace(6, 3, 3, 1, seed=2), tree_trace(5, requests=120)],
                         ids=["synthetic", "tree"])
def test_at_the_working_set_every_policy_misses_only_first_uses(requests):
    working_set = working_set_bytes(requests)
    first_use_tokens = sum({b.key: b.tokens for r in requests for b in r.blocks}.values())
    best = belady(requests, working_set)
    assert best.hit_tokens == best.total_tokens - first_use_tokens
    for policy, top, lower, admission, through in configurations(working_set):
        result = simulate(requests, policy, top, lower, admission, through, check_integrity=True)
        assert result.hit_tokens == best.hit_tokens, (policy, lower, admission, through)
        assert result.evictions_top == 0


def test_load_trace_round_trips_and_ignores_unknown_keys(tmp_path):
    requests = [Request("u0-r0", chain("ab", "cd"), t=1.5, local_tokens=256, hits=1, tiers=("cpu",), lookup_s=2e-4),
                Request("u0-r1", chain("ab", "cd", "ef", nbytes=40))]
    path = tmp_path / "trace.jsonl"
    write_trace(requests, path)
    assert load_trace(path) == requests
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[0]["model"] = "smollm2"
    lines[0]["blocks"][0]["medium"] = "cpu"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    assert load_trace(path) == requests


@pytest.mark.parametrize("bad, reason", [
    ('{"request": "x", "blocks": [', "Expecting"),
    ('{"request": "x"}', "'blocks' must be a list"),
    ('{"blocks": [{"key": "a", "parent": null, "tokens": 256}]}', "block 0's bytes"),
    ('{"blocks": [{"key": "a", "parent": "z", "tokens": 256, "bytes": 1}]}', "block 0's parent"),
    ('[1, 2]', "expected a JSON object"),
])
def test_a_malformed_line_is_a_one_line_error_naming_it(tmp_path, bad, reason):
    good = json.dumps({"request": "ok", "blocks": [{"key": "a", "parent": None, "tokens": 256, "bytes": 1}]})
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{good}\n{good}\n{bad}\n{good}\n")
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ") and reason in message and "\n" not in message
    with pytest.raises(SystemExit, match=":3: "):
        cache_policy.main([str(path)])


def test_synthetic_rounds_extend_the_previous_chain():
    requests = synthetic_trace(5, 3, context_blocks=2, question_blocks=2, seed=4, shared_system_blocks=1)
    assert synthetic_trace(5, 3, context_blocks=2, question_blocks=2, seed=4, shared_system_blocks=1) == requests
    by_user = defaultdict(list)
    for request in requests:
        by_user[request.request.split("-")[0]].append(request.blocks)
        assert all(b.parent == (a.key if a else None) for a, b in zip((None, *request.blocks), request.blocks))
    assert len(by_user) == 5
    for rounds in by_user.values():
        assert [len(blocks) for blocks in rounds] == [5, 7, 9]
        assert all(later[:len(earlier)] == earlier for earlier, later in zip(rounds, rounds[1:]))
    assert len({blocks[0][0].key for blocks in by_user.values()}) == 1  # the shared system prompt


def test_synthetic_sessions_keep_at_most_active_users_talking():
    requests = synthetic_trace(10, 3, context_blocks=2, question_blocks=1, seed=5, active=3)
    users = [int(r.request.split("-")[0][1:]) for r in requests]
    started = [users.index(u) for u in range(10)]
    finished = [len(users) - 1 - users[::-1].index(u) for u in range(10)]
    assert all(users.count(u) == 3 for u in range(10))
    assert max(sum(s <= i <= f for s, f in zip(started, finished)) for i in range(len(users))) == 3
    with pytest.raises(ValueError, match="excludes zipf"):
        synthetic_trace(10, 3, 2, 1, seed=5, active=3, zipf=1.0)


def test_cli_writes_every_number(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert cache_policy.main(["--synthetic", "--users", "6", "--rounds", "3", "--capacities", "0.5,1",
                              "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["working_set_bytes"] > 0
    # per capacity: belady and every policy alone; belady and each x 2 write modes x 3 admissions below
    assert len(report["runs"]) == 2 * (1 + len(POLICIES) + 1 + 6 * len(POLICIES))
    assert {"hit_ratio", "bytes_written_lower", "lower_bytes_per_hit_token"} <= set(report["runs"][0])
    assert "prefix-lru back ghost" in capsys.readouterr().out
    assert cache_policy.main(["--synthetic", "--users", "6", "--rounds", "3", "--active", "2", "--capacities", "0.5",
                              "--policies", "prefix-tinylfu-duel", "--admissions", "all", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["policy"], r["lower_multiple"], r["write_through"]) for r in runs] == [
        ("belady", 0, True), ("prefix-tinylfu-duel", 0, True), ("belady", 2, True),
        ("prefix-tinylfu-duel", 2, True), ("prefix-tinylfu-duel", 2, False)]
    with pytest.raises(SystemExit):
        cache_policy.main(["--synthetic", "--policies", "lfu"])


def loop_trace(users: int, rounds: int) -> list[Request]:
    """Users in a fixed rotation, each asking for [sys][its own block]: a loop larger than the tier."""
    return [Request(f"u{u}-r{r}", (Block("sys", None, TOKENS, 100), Block(f"u{u}", "sys", TOKENS, 100)))
            for r in range(rounds) for u in range(users)]


def replay(tier, sketch, requests):
    """Hit tokens of each request, replayed on ``tier`` alone, counted in ``sketch`` at lookup as `simulate` does."""
    hits = []
    for request in requests:
        sketch.record(request)
        hits.append(replay_alone(tier, request))
    return hits


def test_tinylfu_keeps_a_stable_subset_of_a_loop():
    # Room for sys + 3 of 6 users. Round 0 stores sys, u0, u1, u2; u3..u5 (no history) lose to the held
    # users (ties at worst) and pass through; from round 1 on u0..u2 hit whole, u3..u5 their sys block.
    # That is Belady's count; LRU and prefix-lru hit sys only: the rotation evicts each user before it
    # comes back. The duel starts as prefix-lru, turns its filter on in round 1 and keeps u3..u5 instead.
    requests = loop_trace(users=6, rounds=5)
    expected = (5 + 4 * (3 * 2 + 3 * 1)) * TOKENS
    assert belady(requests, 400).hit_tokens == expected
    assert simulate(requests, "prefix-tinylfu", 400, check_integrity=True).hit_tokens == expected
    assert simulate(requests, "prefix-tinylfu-duel", 400, check_integrity=True).hit_tokens == expected
    assert simulate(requests, "lru", 400).hit_tokens == simulate(requests, "prefix-lru", 400).hit_tokens == 29 * TOKENS
    sketch = FrequencySketch(64)
    tier = PrefixTinyLFUTier("top", 400, frequency=sketch)
    hits = replay(tier, sketch, requests)
    assert hits[-6:] == [2 * TOKENS] * 3 + [TOKENS] * 3 and set(tier.blocks) == {"sys", "u0", "u1", "u2"}


def test_tinylfu_ties_keep_the_incumbent():
    # One block of room, no aging. Estimates leave out the request being served:
    #   b once:   b 0 vs a 1: rejected        b twice: b 1 vs a 1, a tie: rejected, a stays
    #   b thrice: b 2 vs a 1: admitted, a evicted
    sketch = FrequencySketch(1 << 20)
    tier = PrefixTinyLFUTier("top", 100, frequency=sketch)
    replay(tier, sketch, [Request("a", chain("a"))])
    for held in ("a", "a", "b"):
        replay(tier, sketch, [Request("b", chain("b"))])
        assert set(tier.blocks) == {held}
    assert tier.rejections == 2 and tier.evictions == 1


def test_tinylfu_new_round_inherits_its_parents_estimate():
    # a0 -> a1 asked 3 times, b0 twice; the tier (3 blocks) is full. a2, the next round of A, is new
    # (its own count 0) but the only child of held a1, so it inherits a1's 3 and beats b0's 2.
    sketch = FrequencySketch(1 << 20)
    tier = PrefixTinyLFUTier("top", 300, frequency=sketch)
    replay(tier, sketch, [Request("A", chain("a0", "a1"))] * 3 + [Request("B", chain("b0"))] * 2)
    assert set(tier.blocks) == {"a0", "a1", "b0"}
    replay(tier, sketch, [Request("A", chain("a0", "a1", "a2"))])
    assert set(tier.blocks) == {"a0", "a1", "a2"}
    tier.check_integrity()


@pytest.mark.parametrize("aging", [True, False])
def test_tinylfu_aging_lets_a_new_hot_set_replace_the_old(aging):
    # Room for 3 blocks. Users a0..a2 rotate 20 times (counts saturate at 15), then b0..b2 do. Without
    # aging the a's win every comparison (b's reach 15 at best: a tie) and no b ever hits. With a
    # halving every 16 increments the a's counts fall while the b's rise: every b request from 2
    # aging periods after the change on hits.
    sketch = FrequencySketch(64 if aging else 1 << 20)
    tier = PrefixTinyLFUTier("top", 300, frequency=sketch)
    old = [Request("a", chain(f"a{i}")) for _ in range(20) for i in range(3)]
    new = [Request("b", chain(f"b{i}")) for _ in range(20) for i in range(3)]
    assert all(replay(tier, sketch, old)[3:])
    hits = replay(tier, sketch, new)
    if aging:
        assert sketch.period == 16 and all(hits[2 * sketch.period:]) and set(tier.blocks) == {"b0", "b1", "b2"}
    else:
        assert not any(hits) and set(tier.blocks) == {"a0", "a1", "a2"}


def test_a_rejected_block_passes_down_unwritten():
    # Top: one block; a is held with more history than b, so b is rejected there and demoted to the
    # lower tier (write-back, it lacks b), which has room. b's next request hits in the lower tier.
    requests = [Request("a", chain("a"))] * 2 + [Request("b", chain("b"))] * 2
    result = simulate(requests, "prefix-tinylfu", 100, 200, write_through=False, check_integrity=True)
    assert result.rejections_top == 2 and result.bytes_written_top == 100
    assert result.bytes_written_lower == 100 and result.lower_hit_tokens == TOKENS
    assert result.hit_tokens == 2 * TOKENS


def test_duel_filters_a_loop_and_not_sessions():
    loop = synthetic_trace(12, 6, context_blocks=3, question_blocks=1, seed=0)
    sessions = synthetic_trace(24, 4, context_blocks=3, question_blocks=1, seed=1, active=3)
    for requests, filtering in ((loop, True), (sessions, False)):
        top = working_set_bytes(requests) // 4
        sketch = FrequencySketch(top // requests[0].blocks[0].nbytes)  # as simulate sizes it
        tier = PrefixTinyLFUDuelTier("top", top, frequency=sketch)
        hit_tokens = sum(replay(tier, sketch, requests))
        tier.check_integrity()
        assert tier.filtering is filtering
        assert hit_tokens == simulate(requests, "prefix-tinylfu-duel", top).hit_tokens
        lru = simulate(requests, "lru", top).hit_ratio
        assert hit_tokens / sum(r.tokens for r in requests) >= lru
        if filtering:  # within a point of the optimum, where LRU is 16 below
            best = belady(requests, top).hit_ratio
            assert hit_tokens / sum(r.tokens for r in requests) >= best - 0.01 and best >= lru + 0.15
        else:
            assert tier.rejections == 0  # prefix-lru all along


def test_frequency_sketch_counts_requests_and_halves_them():
    sketch = FrequencySketch(64)  # period: max(16, 64 / 4) increments
    assert sketch.width == 256 and sketch.period == 16
    for _ in range(3):
        sketch.record(Request("A", chain("a0", "a1")))
    assert sketch.estimate("a0") == sketch.estimate("a1") == 3 and sketch.estimate("zz") == 0
    for _ in range(5):
        sketch.record(Request("A", chain("a0", "a1")))  # the 16th increment halves every counter
    assert sketch.halvings == 1 and sketch.estimate("a0") == 4
    with pytest.raises(ValueError, match="keys >= 1"):
        FrequencySketch(0)


def test_mooncake_lines_are_chains_of_512_token_blocks_and_a_shorter_tail(tmp_path):
    """Mooncake's format as it is: ids are keys, each the parent of the next; the last block holds
    input_length - 512 (n-1) tokens; bytes = tokens x --token-bytes; ms timestamps in seconds."""
    path = tmp_path / "mooncake.jsonl"
    path.write_text('{"timestamp": 1500, "input_length": 1100, "output_length": 9, "hash_ids": [0, 7, 8]}\n'
                    '{"timestamp": 2000, "input_length": 512, "output_length": 1, "hash_ids": [0]}\n')
    first, second = load_trace(path, token_bytes=10)
    assert [(b.key, b.parent, b.tokens, b.nbytes) for b in first.blocks] == [
        ("m0", None, 512, 5120), ("m7", "m0", 512, 5120), ("m8", "m7", 76, 760)]
    assert first.t == 1.5 and first.tokens == 1100
    assert [(b.key, b.tokens) for b in second.blocks] == [("m0", 512)]
    report = tmp_path / "out.json"
    assert cache_policy.main([str(path), "--token-bytes", "10", "--policies", "default", "--capacities", "1",
                              "--lower", "0", "--json", str(report)]) == 0
    runs = json.loads(report.read_text())["runs"]
    assert [(r["policy"], r["hit_tokens"]) for r in runs] == [("belady", 512), ("default", 512)]


@pytest.mark.parametrize("bad, reason", [
    ('{"input_length": 1100, "hash_ids": [0, 1]}', "does not fill 2 blocks"),
    ('{"input_length": 1024, "hash_ids": [0, 1, 2]}', "does not fill 3 blocks"),
    ('{"input_length": 10, "hash_ids": []}', "non-empty list"),
    ('{"input_length": 10, "hash_ids": [-1]}', "hash id 0"),
    ('{"input_length": 10, "hash_ids": [1], "timestamp": "soon"}', "milliseconds"),
    ('{"hash_ids": [1]}', "'input_length'"),
])
def test_a_malformed_mooncake_line_is_a_one_line_error_naming_it(tmp_path, bad, reason):
    path = tmp_path / "mooncake.jsonl"
    path.write_text(f'{{"input_length": 5, "hash_ids": [3]}}\n{bad}\n')
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert str(caught.value).startswith(f"{path}:2: ") and reason in str(caught.value)


def test_default_models_the_daemons_default_eviction_and_admission():
    """--policies default must stay what a daemon does when nothing is configured."""
    from kvstore.daemon.config import DaemonConfig

    config = DaemonConfig()
    assert (cache_policy.DEFAULT_POLICY, cache_policy.DEFAULT_ADMISSION) == (config.eviction, config.admission)
    assert config.write_policy == "write-through"
    requests = synthetic_trace(12, 3, context_blocks=4, question_blocks=1, seed=2)
    capacity = working_set_bytes(requests) // 4
    default = simulate(requests, "default", capacity, capacity)
    assert default.policy == "default"
    assert default.hit_tokens == simulate(requests, config.eviction, capacity, capacity).hit_tokens
    with pytest.raises(ValueError, match="daemon's defaults"):
        simulate(requests, "default", capacity, capacity, admission="reused")


@pytest.mark.parametrize("policy", ["segmented", "arc", "prefix-arc", "adaptive"])
def test_frequency_aware_policies_keep_a_reused_set_through_one_off_scans(policy):
    """Requests of a few reused chains between scans of one-off chains larger than the tier: LRU
    loses the reused chains to each scan, the frequency-aware policies keep them."""
    reused = [chain(f"r{i}a", f"r{i}b") for i in range(3)]
    trace, scan = [], 0
    for round_ in range(12):
        for blocks in reused:
            trace.append(Request(f"q{round_}", blocks))
        for _ in range(4):
            trace.append(Request(f"s{scan}", chain(f"s{scan}a", f"s{scan}b", f"s{scan}c")))
            scan += 1
    capacity = 10 * 100
    lru = simulate(trace, "lru", capacity, check_integrity=True)
    other = simulate(trace, policy, capacity, check_integrity=True)
    assert other.hit_ratio > lru.hit_ratio + 0.1, (policy, other.hit_ratio, lru.hit_ratio)
