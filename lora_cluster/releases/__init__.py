"""Adapter releases: immutable versions of an adapter name, the alias a bare name resolves through,
canary steps with their gates, the eval gate, and the audit log (pure policies, injected clocks).

Nothing here imports Ray or torch; the ingress and the admin API wire these objects in.
"""
