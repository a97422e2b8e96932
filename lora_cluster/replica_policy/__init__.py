"""The pure policies of one replica (its engine and its adapter store): plain Python, no torch.

`prefill_plan` (which prefill chunks a step carries: the most urgent first and alone, less urgent
ones short), `prefix_hash` (content addresses of full KV blocks), `slot_urgency` (which adapter slot a
more urgent request takes), `eviction` (an adapter's load priority: which one a tier evicts and what it
prefetches), `tier_stats` (each cache tier's counters and load-latency buckets), `step_cost`
(how a step's measured time is split over its sequences, for metering). The engine and the store
run them; the simulator (`sim`) imports them unchanged, and the ingress's metrics read
`tier_stats`' buckets, so none of them may import torch, Ray or a torch package
(tests/project/test_layering.py).
Nothing is re-exported here.
"""
