"""TRL's reference-model sync (rl.ref_sync_steps, rl.ref_mixup_alpha): every that many steps
the KL reference becomes alpha * policy + (1 - alpha) * reference, and a resumed trainer goes
on with that mixed reference, not the warm start it began from."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from rl_testlib import FakeWorker, client, rl_config, save_warm_start, start_server
from rlax_ps import optim, sharding
from rlax_ps.checkpoint import Checkpointer
from rlax_ps.models import ModelConfig
from rlax_ps.train.publisher import flat_params
from rlax_ps.train.rl import RLTrainer, mix_reference
from rlax_ps.train.rl_loss import LossConfig, ref_sync_settings
from rlax_ps.train.state import restore_state, sharded_init

ALPHA = 0.6


def _flat(params):
  return {k: np.asarray(v, np.float64) for k, v in flat_params(params).items()}


@pytest.mark.parametrize("rl,kl_coef,lora,message", [
    (dict(ref_sync_steps=-1), 0.1, 0, "rl.ref_sync_steps: expected a whole number"),
    (dict(ref_sync_steps=2.5), 0.1, 0, "rl.ref_sync_steps: expected a whole number"),
    (dict(ref_mixup_alpha=0.0), 0.1, 0, r"rl.ref_mixup_alpha: expected the policy's share in"),
    (dict(ref_mixup_alpha=1.5), 0.0, 0, r"rl.ref_mixup_alpha: expected the policy's share in"),
    (dict(ref_sync_steps=4), 0.0, 0, "rl.ref_sync_steps: expected 0 with loss.kl_coef=0.0"),
    (dict(ref_sync_steps=4), 0.1, 8, "rl.ref_sync_steps: expected 0 with model.lora_rank=8"),
])
def test_bad_sync_settings_name_the_field(rl, kl_coef, lora, message):
  with pytest.raises(ValueError, match=message):
    ref_sync_settings(ml_collections.ConfigDict(rl), LossConfig(kl_coef=kl_coef), lora)
  assert ref_sync_settings(ml_collections.ConfigDict({}), LossConfig()) == (0, 0.6)  # TRL's
  assert ref_sync_settings(ml_collections.ConfigDict(dict(ref_sync_steps=512, ref_mixup_alpha=1)),
                           LossConfig(kl_coef=0.1)) == (512, 1.0)


def test_the_mix_is_trls_soft_update_and_a_checkpoint_gives_it_back(tmp_path):
  model_cfg = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1, max_position_embeddings=32)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  opt = optim.make_optimizer({"lr": 0.05, "warmup_steps": 0, "min_lr_ratio": 1.0}, 10)
  state, shardings, _ = sharded_init(model_cfg, opt, mesh, seed=0)
  ref = jax.tree.map(lambda x: 0.5 * x + 0.01, state.params)
  mixed = jax.jit(lambda r, p: mix_reference(r, p, ALPHA), out_shardings=shardings.params)(
      ref, state.params)
  policy, before, after = _flat(state.params), _flat(ref), _flat(mixed)
  for k in policy:  # TRL's target.mul_(1 - alpha).add_(policy, alpha=alpha)
    np.testing.assert_allclose(after[k], ALPHA * policy[k] + (1 - ALPHA) * before[k],
                               rtol=1e-6, atol=1e-8, err_msg=k)
  half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), ref)  # the reference's dtype is kept
  assert {x.dtype for x in jax.tree.leaves(mix_reference(half, state.params, ALPHA))} == {
      jnp.dtype(jnp.bfloat16)}
  with Checkpointer(str(tmp_path), async_save=False) as ckpt:
    ckpt.save(3, dict(state.to_tree(), ref_params=mixed), {"mixed_reference": True})
    back, _, _, meta, held = restore_state(model_cfg, opt, mesh, ckpt, 3,
                                           params_like=("ref_params",))
  assert meta == {"mixed_reference": True} and int(back.step) == 0
  restored = _flat(held["ref_params"])
  for k in after:
    np.testing.assert_array_equal(restored[k], after[k], err_msg=k)


@pytest.mark.slow  # a 2-step run against a server, and a restart
def test_the_reference_is_mixed_with_the_policy_and_a_restart_keeps_the_mix(tmp_path):
  warm = str(tmp_path / "warm")
  model = save_warm_start(warm)
  start = _flat(nnx.state(model, nnx.Param).to_pure_dict())
  config = rl_config("tiny")
  config.init_from_hf = warm
  config.rl.steps = 2
  config.rl.ref_sync_steps = 2  # once, after step 2: the final save holds the mixed one
  config.rl.ref_mixup_alpha = ALPHA
  config.loss.kl_coef = 0.05
  config.optimizer.lr = 1e-2  # weights that move well past rounding in two steps
  config.optimizer.warmup_steps = 0
  config.eval.num_examples = config.eval.batch_size = 2
  config.export.hf = False
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4).start()
  try:
    with client(server.address, "trainer") as tc:
      with RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
        tr.train()
        policy, ref = _flat(tr.state.params), _flat(tr.ref_params)
      worker.stop()
      assert max(np.abs(policy[k] - start[k]).max() for k in start) > 1e-4  # it trained
      for k in start:  # TRL: ref = alpha * policy + (1 - alpha) * ref, the warm start here
        np.testing.assert_allclose(ref[k], ALPHA * policy[k] + (1 - ALPHA) * start[k],
                                   rtol=1e-6, atol=1e-7, err_msg=k)
      with RLTrainer(config, str(tmp_path / "rl"), tc) as again:
        assert again.step == 2
        resumed = _flat(again.ref_params)
        assert jax.tree.map(lambda x: x.sharding, again.ref_params) == again.shardings.params
    for k in start:
      np.testing.assert_array_equal(resumed[k], ref[k], err_msg=k)
  finally:
    worker.stop()
    server.stop(grace=0)
