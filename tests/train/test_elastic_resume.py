"""Elastic resume: a run checkpointed on 8 devices (fsdp 8), then preempted, resumes on a
slice of another size and shape with the same step, data position, params and optimizer
state, now laid out on the new mesh, and continues with the losses of the unbroken run; a
batch the new mesh cannot split is named."""

import importlib.util
import os

import jax
import numpy as np
import pytest

from rlax_ps.train.sft import SFTTrainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(data, fsdp, tensor):
  spec = importlib.util.spec_from_file_location("sft_tiny", os.path.join(REPO, "configs",
                                                                          "sft_tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("tiny")
  config.train.steps, config.train.log_every = 5, 1
  config.checkpoint.every_steps, config.checkpoint.async_save = 3, False
  config.export.hf = False
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = data, fsdp, tensor
  return config


def _losses(trainer, until):
  return [trainer.train(until=s + 1, progress=False)["loss"] for s in range(trainer.step, until)]


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.slow  # ~9 s; test_checkpoint_resume restores onto another mesh in the default suite
def test_a_run_saved_on_8_devices_resumes_on_4_with_another_mesh(tmp_path):
  with SFTTrainer(_config(1, 8, 1), str(tmp_path / "unbroken")) as unbroken:
    reference = _losses(unbroken, 3)
    at_3 = _leaves(unbroken.state.to_tree())
    reference += _losses(unbroken, 5)
    final = _leaves(unbroken.state.to_tree())
  with SFTTrainer(_config(1, 8, 1), str(tmp_path / "elastic")) as first:
    first.train(until=4, progress=False)  # preempted after step 4: resumes from step 3
  assert first.checkpointer.all_steps() == [3]
  with SFTTrainer(_config(1, 2, 2), str(tmp_path / "elastic"),
                  devices=jax.devices()[:4]) as resumed:
    assert resumed.step == 3
    assert resumed.checkpointer.metadata(3)["data"]["position"] == 3
    assert dict(resumed.mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
    for x, y in zip(_leaves(resumed.state.to_tree()), at_3):
      np.testing.assert_array_equal(x, y)
    mu = [x for x in jax.tree.leaves(resumed.state.opt_state) if x.ndim][:len(
        jax.tree.leaves(resumed.state.params))]
    assert any(np.abs(np.asarray(m)).max() > 0 for m in mu)  # moments restored, not fresh
    for x, want in zip(jax.tree.leaves(resumed.state.to_tree()),
                       jax.tree.leaves(resumed.shardings.to_tree())):
      assert x.sharding == want and len(x.sharding.device_set) == 4
    assert any("tensor" in str(x.sharding.spec) for x in jax.tree.leaves(resumed.state.opt_state))
    continued = _losses(resumed, 5)
    np.testing.assert_allclose(continued, reference[3:], rtol=2e-6)
    for x, y in zip(_leaves(resumed.state.to_tree()), final):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_batch_the_devices_cannot_split_is_named_before_any_step(tmp_path, caplog):
  config = _config(-1, 1, 1)
  config.data.batch_size, config.optimizer.grad_accum_steps = 8, 2
  with SFTTrainer(config, str(tmp_path)) as trainer:
    assert trainer.step == 0
  assert ("data.batch_size=8, optimizer.grad_accum_steps=2: 4 rows a micro-batch are not a "
          "multiple of mesh data*fsdp = 8" in caplog.text)
  assert "a multiple of 16 uses every device" in caplog.text
