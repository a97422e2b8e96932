"""bench_sla's requests: a class from the mix, an adapter by Zipf popularity over a0..a7, a prompt of
8-32 words and 16-48 greedy output tokens (EOS ignored). Drawn from the caller's seeded generator,
so that every mode at one load is offered the same sequence."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from lora_cluster.sim.popularity import ZipfSampler

ADAPTERS = [f"a{i}" for i in range(8)]
ZIPF_S = 1.1
POPULARITY = ZipfSampler(len(ADAPTERS), ZIPF_S)
CLASS_MIX = (("interactive", 0.2), ("standard", 0.5), ("batch", 0.3))
PROMPT_WORDS = (8, 32)
OUTPUT_TOKENS = (16, 48)
TEXT = ("the river runs past a quiet town where people trade bread fish salt and wool in the morning "
        "light while children play near old stone walls and boats drift slowly under a grey sky that "
        "promises rain before evening comes over the hills")
WORDS = tuple(TEXT.split(" "))


@dataclass(frozen=True)
class Req:
    cls: str
    adapter: str
    prompt: str
    max_tokens: int


def make_request(rng: random.Random, cls: str | None = None) -> Req:
    if cls is None:
        cls = rng.choices([c for c, _ in CLASS_MIX], [p for _, p in CLASS_MIX])[0]
    adapter = ADAPTERS[POPULARITY.draw(rng)]
    words = [rng.choice(WORDS) for _ in range(rng.randint(*PROMPT_WORDS))]
    return Req(cls, adapter, " ".join(words), rng.randint(*OUTPUT_TOKENS))


def body(req: Req, stream: bool = True) -> dict[str, Any]:
    return {"model": req.adapter, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
