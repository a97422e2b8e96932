"""Content addresses of full KV blocks: a hash chain over the weights and every token up to the block.

The keys and values of a block depend on the weights that computed them (the base model plus one
adapter's weights, of one version) and on every token at or before the block's last position. So a
full block of `block_size` tokens is addressed by

    root     = H("adapter", adapter id, version)   or   H("base")  (no adapter)
    key(0)   = H(root,       token ids of block 0)
    key(i)   = H(key(i - 1), token ids of block i)

Invariants:
* Two blocks have the same key only if they were computed with the same adapter id at the same
  version (the base model: no adapter) from the same tokens in the same positions, up to collisions
  of the 128-bit BLAKE2b digest. A merged adapter's id hashes its recipe (`store.merged`) and its
  version follows its adapters' versions, so the recipe is in the key as well.
* A new version of an adapter id (re-registered, reloaded, invalidated: `store.versions`) gives a new
  root, hence new keys for every block: blocks of the old version are unreachable at once, no scan.
* Only full blocks have keys; a partial block is never shared.
* Keys are deterministic across processes and machines (BLAKE2b, not Python's salted `hash`), so a
  replica may report them.

Pure functions, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from hashlib import blake2b

DIGEST_BYTES = 16
TokenAt = Callable[[int], int]  # token id at a position of a sequence


def _digest(*parts: bytes) -> bytes:
    h = blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def chain_root(adapter_id: str | None, version: int) -> bytes:
    """The root of the chains of blocks computed with `adapter_id` at `version` (None: the base
    model, whose version is ignored)."""
    if adapter_id is None:
        return _digest(b"base")
    return _digest(b"adapter", adapter_id.encode(), version.to_bytes(8, "little", signed=True))


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block with `tokens`, whose previous block's key (or the root) is `parent`."""
    return _digest(parent, b"".join(t.to_bytes(4, "little") for t in tokens))


def extend_keys(keys: list[bytes], root: bytes, token_at: TokenAt, num_tokens: int, block_size: int) -> None:
    """Append to `keys` (the keys of a sequence's first blocks, in order) the keys of its further
    blocks that `num_tokens` tokens fill completely."""
    for i in range(len(keys), num_tokens // block_size):
        parent = keys[i - 1] if i else root
        keys.append(block_key(parent, [token_at(p) for p in range(i * block_size, (i + 1) * block_size)]))
