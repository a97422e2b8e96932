"""One constrained sequence's grammar state: its compile, then its own matcher.

Lifecycle: COMPILING (the sequence waits in the queue and is not scheduled; others run) -> READY
(the sequence holds a matcher copied from the compiled grammar) or FAILED (the compile's
`RequestError`; the engine ends the request with it). Nothing is reserved while compiling: an abort
just drops the sequence, and the compile finishes into the cache for later requests.

Invariant: the matcher has consumed exactly the sequence's output tokens. `accept` is called once
per sampled token (the engine's `_append`); a preempted sequence keeps its matcher with its output,
and recomputing prompt + output does not call `accept`, so nothing is consumed twice. The token to
accept was sampled under this matcher's mask, so a refusal is an engine fault, raised as one.
"""

from __future__ import annotations

import llguidance

from lora_cluster.engine.sample.grammar_compiler import Compile, CompiledGrammar
from lora_cluster.errors import EngineStepError, RequestError


class GuidedState:
    """The grammar side of one sequence (see the module docstring)."""

    def __init__(self, compile: Compile):
        self._compile: Compile | None = compile
        self.matcher: llguidance.LLMatcher | None = None
        self.error: RequestError | None = None

    def ready(self) -> bool:
        """True once the matcher is in hand; False while compiling or when `error` is set."""
        if self.matcher is not None:
            return True
        if self._compile is None:
            return False
        outcome = self._compile.outcome()
        if outcome is None:
            return False
        self._compile = None  # the sequence no longer needs the compile (the cache may drop it)
        if isinstance(outcome, CompiledGrammar):
            self.matcher = outcome.matcher()
            return True
        self.error = outcome
        return False

    def accept(self, token: int) -> bool:
        """Consume a sampled token; True when the grammar is complete (only end-of-sequence may follow)."""
        matcher = self.matcher
        if matcher is None:
            raise EngineStepError("a constrained sequence was sampled before its grammar was ready")
        if not matcher.consume_token(token):
            raise EngineStepError(f"the grammar refused token {token} that its mask allowed: "
                                  f"{matcher.get_error()[:200]}")
        return matcher.is_stopped()
