r"""rlax-ps local --config=configs/rl_ppo.py --workdir=runs/rl_ppo

PPO with a critic, as verl runs it by default (algorithm.adv_estimator=gae): a value model
(the policy's body and a value head, starting from the warm start's weights with a zero
head) scores the state before each response token; GAE (gamma, lam) over those values and
the verifier's score on the last token gives each token its advantage, whitened over the
step's response tokens, and its return, which the critic regresses on with verl's clipped
value loss (critic.value_clip) and an optimizer of its own (critic.optimizer: verl's critic
learns 10x faster than its actor). The critic is checkpointed with the policy; it doubles the
trainer's weights and optimizer state, except in a LoRA run (configs/rl_lora.py with
--config.loss.advantage=gae), whose critic trains adapters of its own and its head over the
policy's frozen weights. --config.critic.init_from_hf=RM_PATH starts it from a reward model
instead (InstructGPT's critic; in a LoRA run, adapters over the reward model's frozen
weights), --config.critic.warmup_steps=N trains it alone first (the
`critic` block: configs/rl_local.py). Otherwise configs/rl_local.py. `:tiny` is the
seconds-long smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.loss.advantage = "gae"
  c.loss.gamma = 1.0  # verl's algorithm.gamma and lam
  c.loss.lam = 1.0
  c.critic.optimizer.lr = c.optimizer.get_ref("lr") * 10  # (follows an optimizer.lr override)
  return c
