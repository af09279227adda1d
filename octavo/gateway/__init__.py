"""``octavo gateway``: one OpenAI-compatible endpoint in front of many ``octavo serve`` replicas.

Routing (round-robin, least-load, prefix, kv-aware, session), health probes and
a circuit breaker per replica, a response cache for deterministic requests and
rate limits per API key. Torch-free: it talks to replicas over HTTP and ZMQ only.
"""
