"""A worker whose model differs from the publisher's where shapes do not show it (rope_theta,
norm eps, ...) refuses the weights, naming each field and both values; the same model's
updates apply, and so do updates that carry no model fields (older publications)."""

import pytest

from inference_workers.loop import Worker
from inference_workers.weights import HeldPolicy, WeightsDoNotFit
from inference_workers.worker_config import WorkerConfig
from worker_testlib import (CONFIG, SMALL, TOKENIZER, PublishingClient, assert_refused_whole,
                            published)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_keyframe_of_another_rope_theta_is_refused_naming_the_field(fmt):
  policy = HeldPolicy(CONFIG, fmt)
  other = CONFIG.replace(rope_theta=5.0)  # every tensor's shape the same
  keyframe, _ = published(other, fmt)
  policy.check_fits(keyframe)  # the shapes alone fit
  with pytest.raises(WeightsDoNotFit) as e:
    policy.apply(keyframe)
  message = str(e.value)
  assert "model.rope_theta: published 5.0, this worker's 10000.0" in message
  assert_refused_whole(message, policy)


def test_every_differing_field_is_named_with_both_values():
  policy = HeldPolicy(CONFIG)
  keyframe, _ = published(CONFIG.replace(rms_norm_eps=1e-5, hidden_act="gelu_tanh"))
  with pytest.raises(WeightsDoNotFit, match=r"model\.hidden_act: published 'gelu_tanh', this "
                                            r"worker's 'silu'; model\.rms_norm_eps: published "
                                            r"1e-05, this worker's 1e-06; give"):
    policy.apply(keyframe)


def test_the_same_models_keyframe_and_delta_apply():
  policy = HeldPolicy(CONFIG.replace(dtype="bfloat16"))  # the compute dtype is the worker's
  keyframe, params = published(CONFIG)
  policy.apply(keyframe)
  delta, _ = published(CONFIG, version=1, base=params)
  policy.apply(delta)
  assert policy.version == 1


def test_updates_without_model_fields_apply_unchecked():
  policy = HeldPolicy(CONFIG)
  keyframe, params = published(CONFIG, fields=False)
  delta, _ = published(CONFIG, version=1, base=params, fields=False)
  assert keyframe.model is None and delta.model is None
  policy.apply(keyframe)
  policy.apply(delta)
  assert policy.version == 1


def test_a_delta_of_another_model_after_a_keyframe_without_fields_is_refused():
  # A keyframe a server compacted from a chain carries no fields: the next delta does.
  policy = HeldPolicy(CONFIG)
  other = CONFIG.replace(rope_theta=5.0)
  keyframe, params = published(other, fields=False)
  policy.apply(keyframe)
  delta, _ = published(other, version=1, base=params)
  with pytest.raises(WeightsDoNotFit, match="model.rope_theta: published 5.0"):
    policy.apply(delta)
  assert policy.version == 0  # the delta changed nothing


def test_the_worker_stops_at_a_keyframe_of_another_rope_theta():
  # The worker's run ends in WeightsDoNotFit, which `rlax-ps worker` prints as one line
  # and exits 1 on (test_weights_that_do_not_fit.py).
  keyframe, _ = published(CONFIG.replace(rope_theta=5.0))
  worker = Worker(PublishingClient(keyframe), CONFIG, TOKENIZER, WorkerConfig(**SMALL))
  with pytest.raises(WeightsDoNotFit, match="model.rope_theta"):
    worker.run()
  assert worker.policy.version is None and worker.stats.resyncs == 0
