"""The schedule room: which sequences run in a step, and the KV cache blocks they hold.

`sequence` (a request's life in the engine: `Sequence`, `SeqStatus`, `snapshot`), `scheduler`
(continuous batching, priorities, recompute preemption, the admission `Gate`), `kv_cache` (the
paged cache: block allocator and block tensors), `prefix_cache` (full blocks by content) and
`counters` (steps, batch sizes, tokens, adapter placements, for metrics). It imports only the
sample room (a sequence carries its detokenizer and grammar matcher); the adapter room above it
answers the scheduler's gate through the callables the composition root wires in.
"""
