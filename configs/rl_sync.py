r"""rlax-ps local --config=configs/rl_sync.py --workdir=runs/rl_sync

Fully synchronous RL: max_staleness 0, so every group is sampled by the newest version and
the trainer waits for the workers (one step of prompts in flight). With one worker
(`--config.local.workers=1`) a run repeats exactly for one `seed`, in any workdir, resumed
or not; with more, which groups a step takes depends on which finish first. Otherwise
configs/rl_local.py. `:tiny` is the seconds-long smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.rl.max_staleness = 0
  return c
