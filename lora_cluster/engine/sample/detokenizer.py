"""Incremental detokenization: constant work per new token, never emits half a UTF-8 character.

Byte-level BPE tokens can split a character; decoding the last emitted chunk plus the new tokens
and holding back text that ends in U+FFFD (an incomplete byte sequence) keeps streamed deltas
exact. The concatenated deltas equal `tokenizer.decode(all_output_ids, skip_special_tokens=True)`
up to that held-back tail, which `flush` releases when the sequence ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IncrementalDetokenizer:
    """Per-sequence state over the sequence's output token ids."""

    tokenizer: object
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = field(default="")

    def step(self, ids: list[int]) -> str:
        """Text newly made certain by `ids` (all output ids so far); appended to `self.text`."""
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        self.text += delta
        return delta

    def flush(self, ids: list[int]) -> str:
        """Release whatever is still held back (an incomplete character is emitted as U+FFFD)."""
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.read_offset = len(ids)
        self.text += delta
        return delta
