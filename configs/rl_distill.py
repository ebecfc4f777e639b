r"""rlax-ps local --config=configs/rl_distill.py --workdir=runs/rl_distill --config.teacher.path=TEACHER_HF_DIR

On-policy distillation (as Thinking Machines' and Qwen3's): the workers sample from the
student as in RL; the trainer's teacher, an HF checkpoint of the same tokenizer, scores
every sampled token, and each token's advantage is log pi_teacher - log pi_sampled (minus
the reverse KL to the teacher), trained with the bf16 recipe's PPO-clip. The rewards are
logged, not trained on; train/teacher_kl is the reverse KL left. One sample a prompt
suffices (no group baseline). Otherwise configs/rl_local.py. `:tiny` is the seconds-long
smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.loss.advantage = "opd"
  return c
