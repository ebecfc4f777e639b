"""The `sft` job on the :tiny config, in process: trains on the 8-device mesh, writes
TensorBoard events, checkpoints and an HF export that loads back, reports held-out exact
match; a rerun on the same workdir resumes instead of starting over; and training learns
(loss and held-out exact match against the untrained model)."""

import glob
import json
import os
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_ps import config_files
from rlax_ps.models import flatten_params, load_hf_checkpoint
from rlax_ps.tokenizers import CharTokenizer, HFTokenizer
from rlax_ps.train.sft import SFTTrainer, train_and_evaluate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny_config():
  return config_files.load(os.path.join(REPO, "configs", "sft_tiny.py"), "tiny")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("sft"))
  summary = train_and_evaluate(_tiny_config(), workdir, progress=False)
  return workdir, summary


@pytest.mark.slow  # ~4 s
def test_reports_heldout_exact_match_per_task(run):
  _, summary = run
  acc = summary["heldout_exact_match"]
  assert set(acc) == {"addition", "reversal", "all"}
  assert all(0.0 <= v <= 1.0 for v in acc.values())
  assert summary["step"] == 4
  assert np.isfinite(summary["train"]["loss"])


def test_writes_tensorboard_events_and_checkpoints(run):
  workdir, _ = run
  events = glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))
  assert events and os.path.getsize(events[0]) > 0
  steps = sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())
  assert steps[-1] == 4
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f)["step"] == 4


def test_hf_export_loads_back_with_the_trained_weights(run):
  workdir, _ = run
  path = os.path.join(workdir, "hf")
  exported = load_hf_checkpoint(path)
  with SFTTrainer(_tiny_config(), workdir, devices=jax.devices()[:1]) as trainer:
    trained = nnx.merge(trainer.graphdef, trainer.state.params)
    assert exported.config == trainer.model_config
  want = flatten_params(trained)
  got = flatten_params(exported)
  assert set(got) == set(want)
  for name in want:  # Equal weights and config: equal logits (parity is tested in models/).
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
  tok = HFTokenizer(path)
  assert tok.encode("rev abc=") == CharTokenizer().encode("rev abc=")
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["eos_token_id"] == CharTokenizer().eos_id


def test_rerun_resumes_at_the_final_step(run, capsys):
  workdir, first = run
  again = train_and_evaluate(_tiny_config(), workdir, progress=False)
  assert again["step"] == 4
  assert again["heldout_exact_match"] == first["heldout_exact_match"]
  out = capsys.readouterr().out
  assert "resuming from checkpoint step 4" in out and "held-out exact match:" in out


def test_training_learns_what_an_untrained_model_cannot(tmp_path):
  """The tiny model on short reversals: 300 steps cut the training loss at least 4x and
  take held-out exact match (64 distinct problems) from the untrained model's (none) to at
  least 40%."""
  config = _tiny_config()
  config.tasks.addition.weight = 0.0
  config.tasks.reversal.max_len = 4
  config.train.steps = 300
  config.train.log_every = 10
  config.data.batch_size = 16
  config.optimizer.warmup_steps = 20
  config.checkpoint.every_steps = 0
  config.export.hf = False
  config.eval.num_examples = 64
  config.eval.batch_size = 64
  with SFTTrainer(config, str(tmp_path)) as trainer:
    untrained = trainer.evaluate()["all"]
    first = trainer.train(until=10, progress=False)["loss"]
    last = trainer.train(progress=False)["loss"]
    trained = trainer.evaluate()["all"]
  assert last < first / 4, (first, last)
  assert untrained <= 0.05 and trained >= 0.4, (untrained, trained)


# SIGHUP slow (suite time): the same handler (run.STOP_SIGNALS) as SIGTERM's case.
@pytest.mark.parametrize("signum", [signal.SIGTERM,
                                    pytest.param(signal.SIGHUP, marks=pytest.mark.slow)],
                         ids=lambda s: signal.Signals(s).name)
def test_sigterm_checkpoints_the_step_reached_and_stops(tmp_path, signum):
  """A SIGTERM (a preempted VM), or a SIGHUP (its terminal closed: `rlax-ps local`'s warm
  start runs in the terminal's process group), finishes the step and checkpoints it: the run
  loses nothing and a rerun resumes there (the default handler ended it with none)."""
  config = _tiny_config()
  config.train.steps = 100000
  config.checkpoint.every_steps = 0
  config.export.hf = False
  before = signal.getsignal(signum)  # (another test of this process may have set one)
  timer = threading.Timer(1.0, os.kill, (os.getpid(), signum))
  timer.start()
  try:
    summary = train_and_evaluate(config, str(tmp_path), progress=False, stop_on_signals=True)
  finally:
    timer.cancel()
  assert summary["stopped"] == signum
  assert summary["step"] < config.train.steps
  assert signal.getsignal(signum) is before  # restored
  with SFTTrainer(config, str(tmp_path), devices=jax.devices()[:1]) as resumed:
    assert resumed.step == summary["step"]
    assert resumed.checkpointer.all_steps() == [summary["step"]]


def test_updates_with_non_finite_gradients_are_skipped_and_too_many_stop_the_run(tmp_path,
                                                                                 caplog):
  """Steps whose loss (so gradients) are NaN from step 3 on: skipped, said at the next
  logged step, and optimizer.max_nonfinite_steps in a row stop the run there, before its
  checkpoint, with step 2's weights; the counts are read only where metrics are logged."""
  from rlax_ps.train.publisher import flat_params
  from rlax_ps.train.step import make_train_step, sft_loss_sum

  config = _tiny_config()
  config.train.steps, config.train.log_every, config.train.eval_every = 12, 2, 0
  config.checkpoint.every_steps, config.checkpoint.async_save = 2, False
  config.optimizer.max_nonfinite_steps = 4
  config.export.hf = False

  def nan_after_two(params, graphdef, batch):
    loss, metrics = sft_loss_sum(params, graphdef, batch)
    return loss * jnp.where(batch["step"] >= 2, jnp.nan, 1.0), metrics

  with SFTTrainer(config, str(tmp_path), devices=jax.devices()[:1]) as trainer:
    step = make_train_step(trainer.graphdef, trainer.optimizer, trainer.shardings,
                           trainer.mesh, loss_sum_fn=nan_after_two, schedule=trainer.schedule)
    calls = []

    def counted(state, batch):
      calls.append(flat_params(jax.device_get(state.params)))
      return step(state, dict(batch, step=jnp.asarray(len(calls) - 1)))

    trainer.train_step = counted
    with caplog.at_level("WARNING"), pytest.raises(
        FloatingPointError, match=r"last 4 updates \(step 6\).*max_nonfinite_steps=4"):
      trainer.train(progress=False)
    assert trainer.checkpointer.all_steps() == [2, 4]  # none after the 4th NaN in a row
    after = flat_params(jax.device_get(trainer.state.params))
  for name, value in calls[2].items():  # step 2's weights, kept by every skipped update
    np.testing.assert_array_equal(value, after[name], name)
  assert "step 4: 2 update(s) skipped since step 2" in caplog.text


def test_a_stop_one_process_of_a_slice_was_asked_for_is_every_processs(tmp_path, monkeypatch):
  """On a multi-host slice the stop check is agreed, and so is what follows it: every
  process then holds the stop and its signal (saves and reports alike; a process without
  them evaluated and exported while the others saved, collectives that never meet)."""
  from jax.experimental import multihost_utils

  config = _tiny_config()
  config.export.hf = False
  with SFTTrainer(config, str(tmp_path), devices=jax.devices()[:1]) as trainer:
    other = np.asarray([0, 0], np.int32)  # what the other process says: [stop, its signal]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: np.stack([np.asarray(x), other]))
    assert not trainer._stopping() and trainer.stop_signal is None
    other[:] = [1, int(signal.SIGTERM)]
    assert trainer._stopping()
    assert trainer._stop.is_set() and trainer.stop_signal == signal.SIGTERM


def test_nothing_held_out_trains_exports_and_reports_without_evaluating(tmp_path, capsys):
  """eval.num_examples=0: no evaluation, at eval_every or at the end (the end's crashed on
  max() of nothing, after the save: no export and no summary, on every rerun)."""
  config = _tiny_config()
  config.train.steps, config.train.eval_every = 2, 1
  config.eval.num_examples = 0
  summary = train_and_evaluate(config, str(tmp_path), progress=False)
  assert summary["heldout_exact_match"] is None and summary["step"] == 2
  assert os.path.isfile(os.path.join(summary["export"], "config.json"))
  assert "held-out: no examples, not evaluated" in capsys.readouterr().out
  with open(tmp_path / "summary.json") as f:
    assert json.load(f)["heldout_exact_match"] is None
