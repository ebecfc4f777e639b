"""OLMo 2 and 3 checkpoints beyond the logits (test_hf_parity): the config fields and
transformers' defaults, each OLMo feature moves the fixtures' logits (so the parity test
checks it), the packed RL loss trains the post-norms and the q/k norms, a worker holding the
int8 keyframe computes the dequantized model's logits, and configs OLMo cannot hold are named."""


import jax
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import fixture_config, fixture_model, forward, reference
from inference_workers.weights import HeldPolicy
from rlax_ps import sync
from rlax_ps.models import (Transformer, assign_params, config_from_hf, config_to_hf,
                            flatten_params)
from rl_grads import rl_loss_and_grads


def test_config_fields_and_transformers_defaults():
  olmo2 = config_from_hf(fixture_config("olmo2"))
  assert (olmo2.architecture, olmo2.post_norms, olmo2.qk_norm, olmo2.qk_norm_across_heads,
          olmo2.sliding_window, olmo2.head_dim, olmo2.rope_theta) == (
              "olmo2", True, True, True, None, 8, 5e5)
  olmo3 = config_from_hf(fixture_config("olmo3"))
  assert [olmo3.layer_window(i) for i in range(4)] == [6, 6, 6, None]
  assert olmo3.rope_scaling["rope_type"] == "yarn" and olmo3.rope_local_theta == 5e5
  # What transformers' Olmo2Config/Olmo3Config assume for fields a config.json leaves out:
  # RMS eps 1e-5; a 4096 window on 3 of every 4 layers; RoPE base 5e5 for OLMo 3.
  d = fixture_config("olmo3", "config_4x.json")
  for key in ("rms_norm_eps", "sliding_window", "layer_types", "rope_theta"):
    del d[key]
  d.update(num_hidden_layers=8, max_position_embeddings=8192)
  default = config_from_hf(d)
  assert default.rms_norm_eps == 1e-5 and default.rope_theta == default.rope_local_theta == 5e5
  assert [default.layer_window(i) for i in range(8)] == [4096] * 3 + [None] + [4096] * 3 + [None]
  # An OLMo 3 checkpoint's 4.x config has one RoPE base; its sliding layers take it unscaled.
  d = fixture_config("olmo3", "config_4x.json")
  assert "rope_local_base_freq" not in d
  assert config_from_hf(dict(d, rope_theta=1e4)).rope_local_theta == 1e4


@pytest.mark.parametrize("undo", ["window", "local-rope-unscaled", "global-yarn"])
def test_each_olmo3_feature_moves_the_reference_logits(undo):
  # With the feature undone the same weights give clearly different logits, so the parity
  # test really checks the window, the sliding layers' unscaled RoPE and the full layer's YaRN.
  c = config_from_hf(fixture_config("olmo3"))
  edited = {"window": dict(sliding_window=None, layer_types=None),
            "local-rope-unscaled": dict(rope_local_theta=None),
            "global-yarn": dict(rope_scaling=None)}[undo]
  model = fixture_model("olmo3")
  other = Transformer(c.replace(**edited), rngs=nnx.Rngs(0))
  nnx.update(other, nnx.state(model, nnx.Param))
  tokens, logits = reference("olmo3")
  assert np.abs(np.asarray(forward(other, tokens)) - logits).max() > 1e-2


def test_the_packed_rl_loss_trains_the_post_norms_and_the_qk_norms():
  model = fixture_model("olmo2")
  loss, grad = rl_loss_and_grads(model, response_len=5, vocab_hi=70)
  assert np.isfinite(float(loss))
  layer = grad["layers"][0]
  assert set(layer) == {"attn", "attn_out_norm", "mlp", "mlp_out_norm"}  # no pre-norms
  assert layer["attn"]["q_norm"]["scale"].shape == (32,)  # across all 4 heads of 8
  for g in (layer["attn_out_norm"]["scale"], layer["mlp_out_norm"]["scale"],
            layer["attn"]["q_norm"]["scale"], layer["attn"]["k_norm"]["scale"]):
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0


def test_an_int8_worker_computes_the_dequantized_models_logits():
  model = fixture_model("olmo3")
  params = {k: np.asarray(v) for k, v in flatten_params(model).items()}
  policy = HeldPolicy(model.config, "int8")
  policy.apply(sync.encode(None, params, "int8", version=0))
  reference = Transformer(model.config, rngs=nnx.Rngs(0))
  assign_params(reference, sync.dequantize(sync.held_state(params, "int8")))
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, model.config.vocab_size)
  np.testing.assert_allclose(np.asarray(forward(policy.model, tokens)),
                             np.asarray(forward(reference, tokens)), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("changes,field", [
    (dict(qk_norm=False), "qk_norm_across_heads"),
    (dict(sandwich_norms=True), "post_norms"),
    (dict(post_norms=False), "post_norms"),
])
def test_configs_olmo_cannot_hold_are_named(changes, field):
  olmo = config_from_hf(fixture_config("olmo2"))
  with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
    config_to_hf(olmo.replace(**changes))
