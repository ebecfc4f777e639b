"""A worker given another model than the trainer publishes: the first keyframe is refused
in one line that names the first differing tensor and its shapes and says what to give the
worker (the trainer's config), and `rlax-ps worker` exits 1 without a traceback."""

import subprocess
import sys
import textwrap

import pytest

from child_env import child_env
from inference_workers.loop import Worker
from inference_workers.weights import HeldPolicy, WeightsDoNotFit
from inference_workers.worker_config import WorkerConfig
from worker_testlib import (CONFIG, MODEL, REPO, SMALL, TOKENIZER, TOKENS, PublishingClient,
                            assert_refused_whole, client, published)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_keyframe_of_other_shapes_names_the_first_tensor_and_both_shapes(fmt):
  policy = HeldPolicy(CONFIG, fmt)
  # k/v projections twice as wide
  wider = published(CONFIG.replace(num_kv_heads=4), fmt, fields=False)[0]
  with pytest.raises(WeightsDoNotFit) as e:
    policy.apply(wider)
  message = str(e.value)
  name = next(n for n in sorted(wider.tensors)
              if tuple(wider.tensors[n].shape) != tuple(policy.held_state()[n].shape))
  assert (f"tensor {name!r} is published {list(wider.tensors[name].shape)}, "
          f"{list(policy.held_state()[name].shape)} in this model") in message
  assert_refused_whole(message, policy)


def test_a_keyframe_of_more_layers_names_a_tensor_this_model_lacks():
  policy = HeldPolicy(CONFIG)
  deeper = published(CONFIG.replace(num_layers=3), fields=False)[0]
  with pytest.raises(WeightsDoNotFit, match=r"tensor 'layers\.2\.[^']+' \[\d+(, \d+)*\] "
                                            r"is published, not in this model"):
    policy.apply(deeper)


def test_a_keyframe_that_fits_still_applies():
  policy = HeldPolicy(CONFIG)
  policy.apply(published(CONFIG, fields=False)[0])
  assert policy.version == 0


def test_the_worker_stops_at_the_first_keyframe_that_does_not_fit():
  fake = PublishingClient(published(CONFIG.replace(num_layers=3), fields=False)[0])
  worker = Worker(fake, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
  with pytest.raises(WeightsDoNotFit):
    worker.run()
  assert worker.stats.resyncs == 0 and worker.policy.version is None
  assert fake.pulls[0] is None  # a keyframe; no second pull


def test_rlax_ps_worker_says_the_weights_do_not_fit_in_one_line(server, tmp_path):
  with client(server, "trainer") as trainer:
    trainer.publish(published(CONFIG.replace(num_layers=3), fields=False)[0].to_bytes())
  config = tmp_path / "worker_config.py"
  config.write_text(textwrap.dedent(f"""
      import ml_collections
      def get_config():
        return ml_collections.ConfigDict(dict(
            tokenizer=dict(kind="char"), model=dict(vocab_size=0, **{MODEL!r})))
      """))
  env = dict(child_env(), RLAX_PS_WORKER_TOKEN=TOKENS["worker"], JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "rlax_ps", "worker", f"--address={server.address}",
       f"--config={config}", "--max_new_tokens=16", "--backoff_max_s=0.5"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr
  errors = [l for l in proc.stderr.splitlines() if l.startswith("rlax-ps worker:")]
  assert len(errors) == 1, proc.stderr
  assert "do not fit this worker's model: tensor 'layers.2." in errors[0]
  assert "init_from_hf" in errors[0]


class ReformattedClient(PublishingClient):
  """A server whose newest version is a keyframe, replaced by `publish`."""

  def latest_version(self):
    return self.keyframe.version

  def publish(self, keyframe):
    self.keyframe = keyframe


def test_a_worker_waits_out_versions_of_another_format_and_takes_the_next_in_its_own():
  # A resumed run whose publish.format changed: the server's newest version is still the
  # last run's bf16 one when an int8 worker starts. It is not pulled (the server names its
  # format first) and the worker does not crash; the trainer's int8 keyframe is taken when
  # it comes.
  fake = ReformattedClient(published(CONFIG, "bf16", version=3, fields=False)[0])
  worker = Worker(fake, CONFIG, TOKENIZER, WorkerConfig(**SMALL, weights_format="int8"))
  worker._catch_up()
  worker._catch_up()
  assert worker.policy.version is None and fake.pulls == []
  fake.publish(published(CONFIG, "int8", version=4, fields=False)[0])
  worker._catch_up()
  assert worker.policy.version == 4 and fake.pulls == [None]
