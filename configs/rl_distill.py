r"""rlax-ps local --config=configs/rl_distill.py --workdir=runs/rl_distill --config.teacher.path=TEACHER_HF_DIR

On-policy distillation: the workers sample from the student as in RL; the trainer's
teacher, an HF checkpoint of the same tokenizer, scores them once a step. Each sampled
token's advantage is log pi_teacher - log pi_sampled (minus its reverse KL to the teacher,
as Thinking Machines' and Qwen3's), trained with the bf16 recipe's PPO-clip, and at every
sampled position the forward KL from the teacher's 8 most likely tokens to the student's
joins the loss (GKD on the student's own samples: it names the token the teacher would
have written, where the sampled one only says whether that one pleased it). Distillation
is supervised learning: the warm start's final learning rate. The rewards are logged, not
trained on; train/teacher_kl (0 once the student samples as the teacher would) shows what
is left to learn; train/distill_kl renormalises the teacher's top 8 alone, so it bottoms
out at minus the log of the student's mass on those 8 tokens, not at 0. One sample a
prompt suffices (no group baseline). Otherwise configs/rl_local.py. `:tiny` is the
seconds-long smoke variant.

The teacher on the workers instead (each scores its own finished groups on its devices,
beside decoding, and sends the scores with them; the trainer loads no teacher):
--config.worker.teacher=TEACHER_HF_DIR --config.worker.teacher_topk=8 in place of
--config.teacher.path. A teacher of another tokenizer scores the text of each response,
without top tokens (its vocabulary is not the student's): add
--config.teacher.tokenizer=TEACHER_HF_DIR --config.loss.distill_topk=0 (on the workers:
--config.worker.teacher_tokenizer=TEACHER_HF_DIR; a multi-host trainer needs them there).
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.loss.advantage = "opd"
  c.loss.distill_topk = 8
  c.optimizer.lr = 3e-4  # where configs/sft_tiny.py decays to (3e-3 x 0.1)
  return c
