"""The bench workload: seeded prompts of mixed lengths, the same for every system measured."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Plain prose, tokenized by the model under test; prompts are seeded windows of it.
CORPUS = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his father had
taught him. There were one hundred and twelve of them, worn smooth in the middle by a century of boots. At the
top he trimmed the wick, polished the great lens, and watched the ships slide past the rocks toward the harbour.
In the spring of that year a storm came in from the west, and for three days the sea rose over the breakwater.
Question: Why is the sky blue? Answer: Sunlight is scattered by the molecules of the air, and blue light, having
a shorter wavelength, is scattered more than red light, so the whole sky glows blue when we look away from the sun.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of Spain. Rome is the
capital of Italy. Lisbon is the capital of Portugal, and Vienna is the capital of Austria.
Here is a recipe for a simple tomato soup. First, soften an onion and two cloves of garlic in olive oil. Add a
kilogram of ripe tomatoes, a pinch of salt and a cup of water, and let it simmer for twenty minutes. Blend until
smooth, season with pepper and a few leaves of basil, and serve it hot with bread.
The three most important inventions of the twentieth century are often said to be the transistor, the airplane
and antibiotics. Each changed how people live, travel and survive, and each began as an experiment that few
people believed would matter. In a distant galaxy, a small robot named Pip repaired satellites for a living.
"""

SHORT, MEDIUM, LONG = (8, 32), (48, 128), (160, 256)


@dataclass(frozen=True, slots=True)
class Workload:
    """A request mix: prompt-length buckets, taken in turn, and tokens generated per request (0: the plan's)."""

    name: str
    buckets: tuple[tuple[int, int], ...]
    max_new: int = 0

    @property
    def one_shape(self) -> bool:
        """Every request alike: one prompt length and one generated length."""
        return self.max_new > 0 and len(self.buckets) == 1 and self.buckets[0][0] == self.buckets[0][1]


# Today's closed loop, prompt-heavy: mixed prompts of 8-256 tokens. Decode-heavy: 16-token prompts, 128 generated.
PROMPT_HEAVY = Workload("prompt-heavy", (SHORT, MEDIUM, LONG))
DECODE_HEAVY = Workload("decode-heavy", ((16, 16),), max_new=128)
WORKLOADS = {"prompt": PROMPT_HEAVY, "decode": DECODE_HEAVY}


@dataclass(frozen=True, slots=True)
class Request:
    """One generation: a prompt and how many tokens to generate after it (end-of-text ignored)."""

    rid: int
    prompt: tuple[int, ...]
    max_new: int

    @property
    def max_tokens(self) -> int:
        return len(self.prompt) + self.max_new


def first_per_client(requests: list[Request], per_client: int, concurrency: int) -> list[Request]:
    """What a run at `concurrency` serves: the first `per_client` requests per client (0: all of them).
    Every system gets the same ones, so cutting them cuts repetitions, not comparisons."""
    return requests[: per_client * concurrency] if per_client else requests


def make_requests(
    corpus: list[int],
    n: int,
    max_new: int,
    *,
    seed: int,
    max_prompt: int = LONG[1],
    bos: int | None = None,
    buckets: tuple[tuple[int, int], ...] = PROMPT_HEAVY.buckets,
) -> list[Request]:
    """`n` requests whose prompts are seeded windows of `corpus`, lengths from each bucket in turn."""
    rng = random.Random(seed)
    out = []
    for rid in range(n):
        low, high = buckets[rid % len(buckets)]
        length = min(rng.randint(low, high), max_prompt, len(corpus))
        start = rng.randrange(0, len(corpus) - length + 1)
        body = corpus[start : start + length]
        prompt = [bos, *body[: length - 1]] if bos is not None else body
        out.append(Request(rid, tuple(prompt), max_new))
    rng.shuffle(out)  # mixed lengths arrive interleaved
    return [Request(i, r.prompt, r.max_new) for i, r in enumerate(out)]
