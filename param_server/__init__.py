"""The parameter server: gRPC service for versioned weights, prompt leases and rollouts.

Knows nothing of JAX models: payloads are `rlax_ps.sync` updates (numpy only).
"""
