r"""rlax-ps local --config=configs/rl_int8_tis.py --workdir=runs/rl_int8_tis

int8 publications: workers hold per-channel int8 weights (half the bytes of bf16) and sample
from them; the trainer corrects the rounding gap with truncated importance sampling
(weights min(pi_trainer / pi_worker, 2)). Otherwise configs/rl_local.py. `:tiny` is the
seconds-long smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_local.py", arg)
  c.publish.format = "int8"
  c.worker.weights_format = "int8"
  c.loss.correction = "tis"
  return c
