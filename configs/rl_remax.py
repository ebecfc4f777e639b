r"""rlax-ps local --config=configs/rl_remax.py --workdir=runs/rl_remax

ReMax (Li et al., arXiv 2310.10505), as verl runs it with algorithm.adv_estimator=remax:
each sample's advantage is its reward minus the reward of the prompt's greedy answer, no
std. The workers decode that greedy answer beside each prompt's samples
(worker.greedy_baseline), score it with the same verifier and send its reward with the
group; it is not trained on. Otherwise configs/rl_local.py. `:tiny` is the seconds-long
smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.loss.advantage = "remax"
  c.worker.greedy_baseline = True
  # No length punishment (rl_local's :tiny has one): the greedy baseline's length does not
  # reach the trainer, so it would punish the samples and not their baseline.
  c.loss.overlong_buffer = 0
  return c
