"""The serving benchmark's workload (bench/serving.py): users, their contexts and rounds, and when
each request arrives. Seeded, built from real text, with no hub access and no vLLM import.

Modes (each request is one *turn*: a user's round):

    multi-round   U users share a system prompt; each has its own long context and asks R rounds.
                  Round r's prompt is round r-1's prompt + its answer + a new question, so every
                  prompt extends the user's previous one:

                      |system|context u|q1|a1|q2|a2|q3|
                      '---- round 2's prompt ---'
                      '-------- round 3's prompt ----'

                  Users join one after another and each comes back S = U/2 slots later (S at
                  least 2), so first rounds are spread over the run instead of all coming first,
                  and a user's next round comes after S-1 to 2S-1 other users' requests (U=8, S=4;
                  a slot holds a returning user's round, then a newcomer's first):

                      slot     0  1  2  3  4  5  6  7  8  9 10 11
                      round 1  a  b  c  d  e  f  g  h
                      round 2              a  b  c  d  e  f  g  h
                      round 3                          a  b  c  d  e  f  g  h

                  Round r+1 is sent only once round r has finished (its answer is in the prompt).
    long-doc      U documents, each asked R independent questions (|system|document u|q|), all
                  turns in one shuffled order.
    no-reuse      U x R prompts of the multi-round first round's length that share nothing: no
                  system prompt, and no 256-token chunk of one equals any chunk of another (what
                  the cache costs when nothing repeats).
    trace         a Mooncake-format trace's requests (bench/cache_trace.py reads it), each a turn
                  of its own, sent at the trace's timestamps scaled to the offered QPS. Each
                  ``hash_id`` is a fixed run of ``trace_block_tokens`` synthetic tokens (drawn from
                  the corpus's token ids, seeded by the id), so equal ids give equal tokens and a
                  chain is a prompt; a block of the trace's 512 tokens becomes ``trace_block_tokens``
                  (a shorter last block its share, rounded up), and a chain is cut where its prompt
                  and answer would pass ``trace_max_tokens`` (the model's context):

                      trace     |-- id 0: 512 --|-- id 7: 512 --|-- id 9: 300 --|
                      prompt    |id 0: B        |id 7: B        |id 9: ceil(300 B / 512)|

                  ``trace_sample`` keeps one conversation in N (those whose second block's id is a
                  multiple of N: a conversation's turns share it), ``trace_requests`` the first N
                  requests left. A turn's ``round`` is 2 where a block past its first was in an
                  earlier request (a conversation coming back: "r>=2"), else 1.

Answers: the bench asks for exactly ``answer_tokens`` tokens (greedy, ``ignore_eos``) and carries the
token ids vLLM streamed into the user's history, as LMCache's multi-round QA benchmark carries the
answer text. So prompts past round 1 depend on the model, but their lengths, and hence the working
set, do not.

Arrivals: a Poisson process at the offered QPS, seeded, the same for every engine at a given QPS;
in trace mode the trace's own timestamps, scaled so their mean rate is the offered QPS.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

from cache_trace import MOONCAKE_BLOCK_TOKENS, conversation_sample, load_trace

MODES = ("multi-round", "long-doc", "no-reuse", "trace")
CHUNK_TOKENS = 256  # kvstore's block: no-reuse prompts share no chunk of this many tokens
SYSTEM_TEXT = ("You are a careful assistant. Answer each question about the user's document from the "
               "document alone, briefly and without repeating the question.\n\nReference notes:\n")

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True)
class WorkloadConfig:
    mode: str = "multi-round"
    users: int = 8
    rounds: int = 3
    context_tokens: int = 1024   # per user, the document part (a header line is added)
    system_tokens: int = 128     # shared by all users (multi-round, long-doc)
    answer_tokens: int = 16      # max_tokens of every request, with ignore_eos
    seed: int = 0
    trace: str = ""              # trace mode: a Mooncake-format JSON-lines file
    trace_block_tokens: int = 32  # tokens of one of the trace's 512-token blocks
    trace_max_tokens: int = 8192  # prompt + answer at most (SmolLM2's context): longer chains are cut
    trace_sample: int = 1        # one conversation in N (1: every request)
    trace_requests: int = 0      # the first N requests kept (0: all)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        for name in ("users", "rounds", "context_tokens", "answer_tokens", "trace_block_tokens", "trace_sample"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.system_tokens < 0 or self.trace_requests < 0:
            raise ValueError(f"system_tokens and trace_requests must be 0 or more, got "
                             f"{self.system_tokens} and {self.trace_requests}")
        if (self.mode == "trace") != bool(self.trace):
            raise ValueError("trace mode needs a trace file (--trace FILE), and only trace mode takes one")
        if self.trace_max_tokens < self.trace_block_tokens + self.answer_tokens:
            raise ValueError(f"trace_max_tokens {self.trace_max_tokens} holds no block of {self.trace_block_tokens} "
                             f"tokens and a {self.answer_tokens}-token answer: raise it or lower the block")


@dataclass(frozen=True)
class Corpus:
    """Text the workload is cut from: documents (one per source item) and questions."""

    documents: tuple[str, ...]
    questions: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class Turn:
    """One request: ``head`` (system prompt + the user's context), then the user's history of
    earlier rounds if ``carries_history``, then ``question``. ``follows``: the turn that must
    finish before this one is sent (the same user's previous round), or None."""

    index: int
    user: int
    round: int                   # 1-based; round 1 is cold for every engine
    head: tuple[int, ...]
    question: tuple[int, ...]
    follows: int | None
    carries_history: bool


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    system: tuple[int, ...]
    turns: tuple[Turn, ...]
    source: str
    times: tuple[float, ...] | None = None  # trace mode: each turn's timestamp in the trace, s

    @cached_property
    def placeholder_answers(self) -> dict[int, list[int]]:
        """Each turn's answer before it is known: ``answer_tokens`` ids of its own (negative)."""
        a = self.config.answer_tokens
        return {t.index: [-(t.index * a + i) - 1 for i in range(a)] for t in self.turns}

    def prompt_tokens(self, turn: Turn) -> int:
        """The prompt length of ``turn`` (the answers it carries are ``answer_tokens`` long)."""
        return len(self.prompt(turn, self.placeholder_answers))

    @cached_property
    def max_prompt_tokens(self) -> int:
        return max(self.prompt_tokens(t) for t in self.turns)

    @cached_property
    def working_set_tokens(self) -> int:
        """Distinct prompt prefixes of the whole run, in tokens: what a prefix cache must hold to
        compute each token once (answers as placeholders). Sorted, each prompt adds its tokens past
        its common prefix with the one before it."""
        distinct, previous = 0, ()
        for prompt in sorted(tuple(self.prompt(t, self.placeholder_answers)) for t in self.turns):
            common = next((i for i, (a, b) in enumerate(zip(prompt, previous)) if a != b),
                          min(len(prompt), len(previous)))
            distinct += len(prompt) - common
            previous = prompt
        return distinct

    def prompt(self, turn: Turn, answers: dict[int, list[int]]) -> list[int]:
        """``turn``'s prompt: its head, the user's earlier rounds (question + answer) if it carries
        them, its question. ``answers``: each earlier turn's answer token ids."""
        prompt = list(turn.head)
        if turn.carries_history:
            for earlier in self.turns:
                if earlier.user == turn.user and earlier.round < turn.round:
                    prompt += list(earlier.question) + answers.get(earlier.index, [])
        return prompt + list(turn.question)


# -- corpus -----------------------------------------------------------------------------------

MUSIQUE_DEV = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "musique" / "dev.json"


def load_corpus(path: str | Path | None = None) -> Corpus:
    """MuSiQue's dev set (``../shared/data/musique/dev.json``: each item's paragraphs joined are one
    document) when present or given, else the sample bundled with engine_adapter (always there).
    ``path`` may also name a file in the bundled sample's format."""
    path = Path(path) if path else (MUSIQUE_DEV if MUSIQUE_DEV.is_file() else None)
    if path is None:
        return bundled_corpus()
    items = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(items, dict) and {"document", "questions"} <= set(items):
        return _sample_corpus(items, str(path))
    if not isinstance(items, list) or not items or not all(
            isinstance(i, dict) and {"question", "ctxs"} <= set(i) for i in items):
        raise ValueError(f"{path}: neither a MuSiQue list of {{question, ctxs}} nor {{document, questions}}")
    documents = tuple(" ".join(c["text"] for c in item["ctxs"]) for item in items)
    return Corpus(documents, tuple(item["question"] for item in items), str(path))


def bundled_corpus() -> Corpus:
    """engine_adapter's MuSiQue sample: one ~6k-token document and its questions."""
    sample = json.loads(resources.files("engine_adapter").joinpath("data/musique_sample.json").read_text())
    return _sample_corpus(sample, "engine_adapter/data/musique_sample.json")


def _sample_corpus(sample: dict, source: str) -> Corpus:
    return Corpus((sample["document"],), tuple(q["question"] for q in sample["questions"]), source)


# -- workload ---------------------------------------------------------------------------------


def token_pool(corpus: Corpus, tokenize: Tokenize, need: int) -> list[int]:
    """The corpus's documents tokenized in order, until the pool holds ``need`` tokens (or all)."""
    separator = tokenize("\n\n")
    pool: list[int] = []
    for document in corpus.documents:
        pool += tokenize(document) + separator
        if len(pool) >= need:
            break
    return pool


def window_starts(pool_tokens: int, length: int, count: int, rng: random.Random) -> list[int]:
    """``count`` start offsets of ``length``-token windows of the pool: disjoint where the pool
    holds them all, else evenly spread (overlapping, but each distinct); from a seeded offset."""
    if length > pool_tokens:
        raise ValueError(f"a {length}-token context needs a longer corpus ({pool_tokens} tokens): "
                         f"lower --context-tokens or give --data")
    if count * length <= pool_tokens:
        first = rng.randrange(pool_tokens - count * length + 1)
        return [first + i * length for i in range(count)]
    room = pool_tokens - length + 1
    stride, first = room / count, rng.randrange(room)
    return [(first + round(i * stride)) % room for i in range(count)]


def chunks_of(tokens: Sequence[int], chunk: int = CHUNK_TOKENS) -> set[tuple[int, ...]]:
    """The full ``chunk``-token pieces of ``tokens`` (cache blocks start every ``chunk`` tokens)."""
    return {tuple(tokens[i : i + chunk]) for i in range(0, len(tokens) - chunk + 1, chunk)}


def build_workload(config: WorkloadConfig, corpus: Corpus, tokenize: Tokenize) -> Workload:
    if config.mode == "trace":
        return trace_workload(config, corpus, tokenize)
    rng = random.Random(config.seed)
    prompts = config.users * (config.rounds if config.mode == "no-reuse" else 1)
    pool = token_pool(corpus, tokenize, prompts * config.context_tokens + config.system_tokens + 4096)
    questions = [tokenize(f"\n\nQuestion {i % 1000}: {q}\nAnswer:") for i, q in enumerate(corpus.questions)]
    question_order = list(range(len(questions)))
    rng.shuffle(question_order)

    def question(user: int, round_: int) -> tuple[int, ...]:
        return tuple(questions[question_order[(user * config.rounds + round_) % len(questions)]])

    if config.mode == "no-reuse":
        return _no_reuse(config, corpus, tokenize, pool, question, rng)
    system = tuple(tokenize(SYSTEM_TEXT))[: config.system_tokens] if config.system_tokens else ()
    if config.system_tokens > len(system):  # fill with text from the pool's end
        system += tuple(pool[len(pool) - (config.system_tokens - len(system)) :])
    starts = window_starts(len(pool), config.context_tokens, config.users, rng)
    heads = [system + tuple(tokenize(f"\n\nDocument {u + 1}:\n")) + tuple(pool[s : s + config.context_tokens])
             for u, s in enumerate(starts)]
    users = list(range(config.users))
    rng.shuffle(users)  # the join order
    pairs = staggered(users, config.rounds)
    if config.mode == "long-doc":
        rng.shuffle(pairs)
    turns: list[Turn] = []
    last: dict[int, int] = {}
    asked: dict[int, int] = {}
    for index, (user, round_) in enumerate(pairs):
        asked[user] = asked.get(user, 0) + 1
        multi = config.mode == "multi-round"
        turns.append(Turn(index, user, asked[user], heads[user], question(user, round_),
                          follows=last.get(user) if multi else None, carries_history=multi))
        last[user] = index
    return Workload(config, system, tuple(turns), corpus.source)


def interleave_stride(users: int) -> int:
    """S: the slots between a user's rounds (module docstring); at least 2 where there are 2 users."""
    return min(users, max(2, math.ceil(users / 2)))


def staggered(users: list[int], rounds: int) -> list[tuple[int, int]]:
    """(user, round) in sending order: the user who joins ``i``-th has round ``r`` in slot
    ``i + (r - 1) * S``; within a slot, the returning user before the newcomer."""
    stride = interleave_stride(len(users))
    slots = [(i + (r - 1) * stride, -r, u) for i, u in enumerate(users) for r in range(1, rounds + 1)]
    return [(u, -neg_r) for _, neg_r, u in sorted(slots)]


def _no_reuse(config: WorkloadConfig, corpus: Corpus, tokenize: Tokenize, pool: list[int],
              question: Callable[[int, int], tuple[int, ...]], rng: random.Random) -> Workload:
    """Every prompt its own: a numbered header, then a pool window at its own offset, nudged until
    none of its chunks equals a chunk of an earlier prompt."""
    count = config.users * config.rounds
    starts = window_starts(len(pool), config.context_tokens, count, rng)
    seen: set[tuple[int, ...]] = set()
    turns: list[Turn] = []
    order = [(u, r) for r in range(1, config.rounds + 1) for u in range(config.users)]
    for index, ((user, round_), start) in enumerate(zip(order, starts)):
        header = tuple(tokenize(f"Session {index + 1} of {count}:\n"))
        ask = question(user, round_)
        for shift in range(CHUNK_TOKENS):
            begin = (start + shift) % (len(pool) - config.context_tokens + 1)
            head = header + tuple(pool[begin : begin + config.context_tokens])
            pieces = chunks_of(head + ask)
            if not pieces & seen:
                break
        else:
            raise ValueError(f"{corpus.source} is too short for {count} distinct {config.context_tokens}-token "
                             f"prompts; lower --users, --rounds or --context-tokens, or give --data")
        seen |= pieces
        turns.append(Turn(index, user, round_, head, ask, follows=None, carries_history=False))
    return Workload(config, (), tuple(turns), corpus.source)


def trace_workload(config: WorkloadConfig, corpus: Corpus, tokenize: Tokenize) -> Workload:
    """The trace's requests as turns (module docstring, "trace"), read by bench/cache_trace.py."""
    requests = conversation_sample(load_trace(config.trace, token_bytes=1), config.trace_sample)
    if config.trace_requests:
        requests = requests[: config.trace_requests]
    if not requests:
        raise ValueError(f"{config.trace}: no requests left (trace_sample {config.trace_sample})")
    vocabulary = sorted(set(token_pool(corpus, tokenize, 1 << 16)))
    runs: dict[str, tuple[int, ...]] = {}

    def run_of(key: str) -> tuple[int, ...]:  # the block's tokens: the same for the same id, every run
        if key not in runs:
            rng = random.Random(f"{config.seed}/{key}")
            runs[key] = tuple(rng.choice(vocabulary) for _ in range(config.trace_block_tokens))
        return runs[key]

    room = config.trace_max_tokens - config.answer_tokens
    turns: list[Turn] = []
    seen: set[str] = set()
    for index, request in enumerate(requests):
        prompt: list[int] = []
        for block in request.blocks:
            tokens = -(-block.tokens * config.trace_block_tokens // MOONCAKE_BLOCK_TOKENS)  # ceil: at least 1
            if len(prompt) + tokens > room:
                break  # cut at the context
            prompt += run_of(block.key)[:tokens]
        keys = [b.key for b in request.blocks]
        returning = any(k in seen for k in keys[1:])
        seen.update(keys)
        turns.append(Turn(index, index, 2 if returning else 1, tuple(prompt), (), follows=None, carries_history=False))
    times = tuple(r.t if r.t is not None else float(i) for i, r in enumerate(requests))
    return Workload(config, (), tuple(turns), f"{config.trace} (tokens from {corpus.source})", times)


def arrivals(workload: Workload, qps: float, seed: int) -> list[float]:
    """When each turn is sent (s from the start): the trace's timestamps scaled to a mean rate of
    ``qps`` (the span of N requests (N-1)/qps; evenly spaced if they all share one timestamp), else
    `poisson_arrivals`."""
    if workload.times is None:
        return poisson_arrivals(len(workload.turns), qps, seed)
    if qps <= 0:
        raise ValueError(f"qps must be positive, got {qps}")
    first, span, count = workload.times[0], workload.times[-1] - workload.times[0], len(workload.times)
    if span <= 0:
        return [i / qps for i in range(count)]
    scale = (count - 1) / qps / span
    return [(t - first) * scale for t in workload.times]


def poisson_arrivals(count: int, qps: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of ``count`` requests, a Poisson process of rate ``qps``:
    exponential gaps of mean 1/qps; the first request at 0."""
    if qps <= 0:
        raise ValueError(f"qps must be positive, got {qps}")
    rng = random.Random(f"{seed}/{qps}")
    times, now = [], 0.0
    for i in range(count):
        times.append(now)
        now += rng.expovariate(qps)
    return times
