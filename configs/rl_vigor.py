r"""rlax-ps local --config=configs/rl_vigor.py --workdir=runs/rl_vigor

VIGOR rollout allocation: each worker call spends its budget of samples_per_prompt samples
per prompt in rounds, giving more to the prompts whose rewards vary most, so groups are
unequal (the trainer packs a large group over several rows). Otherwise configs/rl_local.py.
`:tiny` is the seconds-long smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.worker.allocator = "vigor"
  # Its schedule: m0 samples per prompt first, then `rounds` rounds keeping the top `alpha`
  # of prompts by reward variance, each giving `gamma` times more samples ('' = 2, 4, 0.5, 2).
  c.worker.allocator_args = ""
  return c
