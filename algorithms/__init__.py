"""The learning side: advantages, losses, off-policy corrections, allocation, verifiers.

Pure functions on arrays; nothing here knows of gRPC or workers.

- `advantages`: GRPO / Dr. GRPO / batch-std GRPO, MC-GRPO (median, pivot dropped), RLOO,
  over a flat batch with group ids (`groups`), unequal and empty groups allowed.
- `losses`: PPO-clip (clip-higher, dual clip), GSPO, CISPO, KL penalty k1/k2/k3, aggregation modes.
- `corrections`: truncated / masked importance sampling, decoupled PPO, M2PO masking.
- `allocation`: fixed N, VIGOR (budget-exact, resumable rounds), DAPO dynamic sampling.
- `selection`: selective rollouts: records whose groups stay uniform are fed less often.
- `shaping`: DAPO soft overlong punishment.
- `verifiers`: `make_verifier("math" | "code" | "task:<name>")`.
"""
