r"""rlax-ps local --config=configs/rl_dapo.py --workdir=runs/rl_dapo

DAPO: the default's clip-higher and token-mean loss, plus
- dynamic sampling: groups whose rewards are all equal (every sample right, or every one
  wrong) carry no advantage, so the trainer leaves them out and takes more until a step
  holds groups_per_step groups whose rewards vary, taking at most 3 times that many (then
  it fills the step with the first ones left out and logs a warning); left out groups are
  acknowledged with the step, so none comes back; the logged reward_mean and pass_at_n
  are over every group taken (reward_mean_trained: the trained ones);
- soft overlong punishment: a response in the last 20% of worker.max_new_tokens loses up
  to 1 reward, linearly, and a truncated one loses 1.
Otherwise configs/rl_local.py. `:tiny` is the seconds-long smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.rl.dynamic_sampling = True
  c.rl.dynamic_sampling_max_factor = 3.0
  # A reference: the last 20% of whatever worker.max_new_tokens an override sets.
  c.loss.overlong_buffer = (c.worker.get_ref("max_new_tokens") + 4) // 5
  return c
