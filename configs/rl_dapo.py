r"""rlax-ps local --config=configs/rl_dapo.py --workdir=runs/rl_dapo

DAPO's dynamic sampling on top of the default's clip-higher and token-mean loss: groups
whose rewards are all equal (every sample right, or every one wrong) carry no advantage,
so the trainer leaves them out and takes more until a step holds groups_per_step groups
whose rewards vary, taking at most 3 times that many (then it fills the step with the first
ones left out and logs a warning). Left out groups are acknowledged with the step, so none
comes back. Otherwise configs/rl_local.py. `:tiny` is the seconds-long smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.rl.dynamic_sampling = True
  c.rl.dynamic_sampling_max_factor = 3.0
  return c
