r"""rlax-ps local --config=configs/rl_reinforce_pp.py --workdir=runs/rl_reinforce_pp

REINFORCE++ with baseline (arXiv 2501.03262), as verl runs it with
algorithm.adv_estimator=reinforce_plus_plus_baseline and use_kl_in_reward: each response
token's reward is minus 0.001 times its KL to the warm start (k1, verl's kl_penalty "kl",
from the workers' sampling log-probs), the verifier's score on its last token; each sample's
summed reward minus its group's mean is given to its tokens and whitened over all the step's
response tokens. --config.loss.advantage=reinforce_pp drops the group baseline (each token's
return, whitened). Otherwise configs/rl_local.py. `:tiny` is the seconds-long smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.loss.advantage = "reinforce_pp_baseline"
  c.loss.kl_in_reward = 0.001  # verl's kl_ctrl.kl_coef
  c.loss.kl_estimator = "k1"
  return c
