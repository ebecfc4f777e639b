r"""rlax-ps local --config=configs/rl_decoupled.py --workdir=runs/rl_decoupled

Decoupled PPO: the clip is taken against the trainer's own (proximal) policy and each token
is weighted by pi_proximal / pi_behaviour from the workers' log-probs (capped at 5), which
keeps stale or low-precision rollouts usable. Staleness bound 2. Otherwise
configs/rl_local.py. `:tiny` is the seconds-long smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.loss.correction = "decoupled"
  c.rl.max_staleness = 2
  return c
