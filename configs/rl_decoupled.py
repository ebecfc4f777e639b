r"""rlax-ps local --config=configs/rl_decoupled.py --workdir=runs/rl_decoupled

Decoupled PPO: the clip is taken against the trainer's own (proximal) policy and each token
is weighted by pi_proximal / pi_behaviour from the workers' log-probs (capped at 5), which
keeps stale or low-precision rollouts usable. Because each token carries the log-prob it
was drawn with, workers apply a new version between decode chunks at once
(worker.in_flight_updates) instead of letting it wait for the prompts started on the old
one (the tokens after the switch are drawn by the new weights over the old ones' cached
keys and values, and their log-probs are those of that mix). Staleness bound 2 (counted from the oldest version a group saw). Otherwise
configs/rl_local.py. `:tiny` is the seconds-long smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.loss.correction = "decoupled"
  c.rl.max_staleness = 2
  c.worker.in_flight_updates = True
  return c
