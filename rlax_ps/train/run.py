"""What every trainer with a workdir has: TensorBoard events, held-out evaluation by greedy
exact match, a checkpointer to close, and a context manager."""

from __future__ import annotations

import os

from rlax_ps.train import evaluate as evaluate_lib


class TrainerRun:
  """Mixin for a trainer that sets workdir, checkpointer, graphdef, state, tokenizer, tasks,
  heldout and config.eval.batch_size."""

  _writer = None
  last_eval: dict[str, float] | None = None

  @property
  def writer(self):
    if self._writer is None:
      from tensorboardX import SummaryWriter
      self._writer = SummaryWriter(os.path.join(self.workdir, "tb"), flush_secs=10)
    return self._writer

  def evaluate(self) -> dict[str, float]:
    """Held-out exact match per task and over all, with greedy decoding."""
    self.last_eval = evaluate_lib.exact_match(self.graphdef, self.state.params, self.tokenizer,
                                              self.tasks, self.heldout,
                                              batch_size=int(self.config.eval.batch_size))
    return self.last_eval

  def log_eval(self, result: dict[str, float], step: int) -> None:
    for k, v in result.items():
      self.writer.add_scalar(f"eval/exact_match/{k}", v, step)
    self.writer.flush()

  def close(self) -> None:
    self.checkpointer.close()
    if self._writer is not None:
      self._writer.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()
