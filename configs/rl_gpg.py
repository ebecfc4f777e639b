r"""rlax-ps local --config=configs/rl_gpg.py --workdir=runs/rl_gpg

GPG (Group Policy Gradient, arXiv 2504.02546), as verl runs it with
algorithm.adv_estimator=gpg and policy_loss.loss_mode=gpg: the plain policy gradient
-A log pi (no ratio, no clip, no KL), each sample's advantage its reward minus its group's
mean, undivided, the batch's advantages scaled by B / (B - M) where M of its B samples are in
groups of all-equal rewards (the paper's correction: such groups learn nothing and would
shrink the step), at most 20x as in the authors' trainer. --config.loss.scale_rewards=group divides by each group's std as GRPO.
Otherwise configs/rl_local.py. `:tiny` is the seconds-long smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.loss.advantage = "gpg"
  c.loss.policy_loss = "pg"
  return c
