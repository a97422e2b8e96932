"""The engine's adapter slot pool and the policies of its lifecycle and protection.

`pool` (device slots, versioned), `residency` (getting a request's adapter onto the device without
blocking the step loop), `fetch_queue` (host fetches, most urgent first, prefetches last), `copier`
(host-to-device copies off the step thread), `rotation` (which adapters hand their slot over),
`guard` (the switch-rate and load-latency
alerts, the thrash miss penalty), `thrash` (thrash judged by its cost) and `demand` (recent demand
per adapter). Which slot a more urgent request takes is `replica_policy.slot_urgency` (pure, shared
with the simulator). Nothing is re-exported here. Between the schedule room (the scheduler's `Gate`,
`Sequence`, the counters, which it imports) and the model room (which reads the pool).
"""
