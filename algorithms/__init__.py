"""The learning side: advantages, policy losses, off-policy corrections, rollout allocation, verifiers.

Pure functions on arrays; nothing here knows of gRPC or workers.
"""
