"""HeldPolicy: in-place bf16/int8 updates, the int8 forward, checksum mismatches and resyncs."""

import jax
import numpy as np
import pytest
from flax import nnx

from inference_workers.sampler import generate
from inference_workers.sampling import SamplingParams
from inference_workers import weights
from inference_workers.weights import HeldPolicy, ResyncNeeded, WeightsDoNotFit
from rlax_ps import sync
from rlax_ps.models import ModelConfig, Transformer, assign_params, flatten_params
from rlax_ps.sync import patch
from rlax_ps.sync.bits import BF16, UINT_OF

CONFIG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, qkv_bias=True, architecture="qwen2")
UNTIED = CONFIG
TIED = CONFIG.replace(tie_word_embeddings=True)
QWEN3 = CONFIG.replace(qkv_bias=False, qk_norm=True, head_dim=16, architecture="qwen3")
GEMMA3 = QWEN3.replace(
    architecture="gemma3", hidden_act="gelu_tanh", zero_centered_norms=True,
    scale_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=12, sliding_window=3,
    layer_types=("sliding_attention", "full_attention"), rope_local_theta=1e4,
    tie_word_embeddings=True)
GEMMA2 = GEMMA3.replace(architecture="gemma2", qk_norm=False, rope_local_theta=None,
                        attn_logit_softcapping=3.0, final_logit_softcapping=2.0)


@nnx.jit
def forward(model, tokens):
  return model(tokens)


def float_params(config, seed):
  model = Transformer(config, rngs=nnx.Rngs(seed))
  return {k: np.asarray(v) for k, v in flatten_params(model).items()}


def moved(params, density, seed):
  rng = np.random.default_rng(seed)
  return {k: (v + (rng.random(v.shape) < density) * 0.01).astype(np.float32)
          for k, v in params.items()}


def same_bits(held, want):
  """Whether a policy's held bit array is the bit pattern of the held-dtype array `want`."""
  held, want = np.asarray(held), np.asarray(want)
  return (held.dtype == UINT_OF[want.dtype] and held.shape == want.shape
          and held.tobytes() == want.tobytes())


@pytest.fixture(scope="module")
def versions():
  v0 = float_params(UNTIED, 0)
  v1 = moved(v0, 0.02, 1)
  v2 = moved(v1, 0.02, 2)
  return [v0, v1, v2]


# int8 slow (~5 s, suite time): test_fingerprinted_updates_..._without_pulling[int8] applies an
# int8 delta and checks the held bits; [bf16] holds the in-place (donated) update.
@pytest.mark.parametrize("fmt", ["bf16", pytest.param("int8", marks=pytest.mark.slow)])
def test_in_place_deltas_reproduce_the_published_weights(versions, fmt):
  policy = HeldPolicy(UNTIED, fmt)
  policy.apply(sync.encode(None, versions[0], fmt, version=0))
  for v in (1, 2):
    before = policy.held_state()
    delta = sync.encode(versions[v - 1], versions[v], fmt, version=v)
    policy.apply(delta)
    assert policy.version == v
    want = sync.held_state(versions[v], fmt)
    got = policy.held_state()
    assert sorted(got) == sorted(want)
    assert all(same_bits(got[k], want[k]) for k in want)
    # Changed tensors were updated in their own (donated) buffers: no second copy survives.
    patched = [k for k in want if delta.changes(k).kind in ("sparse", "dense")]
    assert patched and all(before[k].is_deleted() for k in patched)


def test_int8_weights_halve_the_bytes_of_bf16():
  assert HeldPolicy(UNTIED, "int8").nbytes < 0.6 * HeldPolicy(UNTIED, "bf16").nbytes


@pytest.mark.parametrize("config", [UNTIED, TIED, QWEN3, GEMMA3, GEMMA2],
                         ids=["untied", "tied", "qwen3", "gemma3", "gemma2"])
def test_int8_forward_equals_the_dequantized_model(config):
  params = float_params(config, 3)
  policy = HeldPolicy(config, "int8")
  policy.apply(sync.encode(None, params, "int8", version=0))
  reference = Transformer(config, rngs=nnx.Rngs(0))
  assign_params(reference, sync.dequantize(sync.held_state(params, "int8")))
  tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, config.vocab_size)
  np.testing.assert_allclose(forward(policy.model, tokens), forward(reference, tokens),
                             atol=2e-3, rtol=2e-3)


def test_checksum_mismatch_demands_a_resync_and_a_keyframe_recovers(versions):
  policy = HeldPolicy(UNTIED, "bf16")
  policy.apply(sync.encode(None, versions[0], "bf16", version=0))
  delta = sync.encode(versions[0], versions[1], "bf16", version=1)
  name = next(n for n in delta.tensors if delta.changes(n).kind == "sparse")
  var = policy._vars[name]
  var.set_value(var[...] + 1)  # the held copy went bad (e.g. a bit flip)
  with pytest.raises(ResyncNeeded, match="checksum"):
    policy.apply(delta)
  assert policy.version is None
  policy.apply(sync.encode(None, versions[1], "bf16", version=1))
  want = sync.held_state(versions[1], "bf16")
  assert policy.version == 1
  assert all(same_bits(policy.held_state()[k], want[k]) for k in want)


def test_a_keyframe_that_fails_half_way_leaves_no_version_held(versions, monkeypatch):
  """A keyframe whose patching fails after some tensors (the device out of memory: new and
  old buffers held at once) leaves old and new tensors: no version is held, so the next
  update is a resync, not a delta on a mix labelled the old version."""
  policy = HeldPolicy(UNTIED, "bf16")
  policy.apply(sync.encode(None, versions[0], "bf16", version=0))

  def out_of_memory(self, held, update):
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

  monkeypatch.setattr(patch.Patcher, "apply", out_of_memory)
  with pytest.raises(RuntimeError, match="out of memory"):
    policy.apply(sync.encode(None, versions[1], "bf16", version=1))
  assert policy.version is None


def test_delta_on_the_wrong_base_demands_a_resync(versions):
  policy = HeldPolicy(UNTIED, "bf16")
  with pytest.raises(ResyncNeeded, match="held version is None"):
    policy.apply(sync.encode(versions[0], versions[1], "bf16", version=1))
  policy.apply(sync.encode(None, versions[0], "bf16", version=0))
  with pytest.raises(ResyncNeeded, match="delta from version 1"):
    policy.apply(sync.encode(versions[1], versions[2], "bf16", version=2))


def test_wrong_format_or_model_is_named(versions):
  with pytest.raises(ValueError, match="fmt"):
    HeldPolicy(UNTIED, "fp8")
  with pytest.raises(ResyncNeeded, match="format"):
    HeldPolicy(UNTIED, "int8").apply(sync.encode(None, versions[0], "bf16", version=0))
  with pytest.raises(WeightsDoNotFit, match="do not fit this worker's model"):
    HeldPolicy(TIED, "bf16").apply(sync.encode(None, versions[0], "bf16", version=0))


def test_a_field_an_older_publisher_lacks_counts_as_its_default(versions):
  """A trainer of an older rlax-ps publishes without the model fields added since: they
  count as their defaults (what it computed with), so workers may be upgraded first."""
  def older(config):
    return {k: v for k, v in config.forward_fields().items() if k != "attn_logit_softcapping"}
  policy = HeldPolicy(UNTIED, "bf16")
  policy.apply(sync.encode(None, versions[0], "bf16", version=0, model=older(UNTIED)))
  assert policy.version == 0
  capped = UNTIED.replace(attn_logit_softcapping=30.0)  # not the default the older one had
  with pytest.raises(WeightsDoNotFit, match=r"attn_logit_softcapping: published None, this "
                                            r"worker's 30\.0"):
    HeldPolicy(capped, "bf16").apply(sync.encode(None, versions[0], "bf16", version=0,
                                                 model=older(capped)))


def test_sampler_runs_the_int8_policy(versions):
  policy = HeldPolicy(UNTIED, "int8")
  policy.apply(sync.encode(None, versions[0], "int8", version=0))
  prompt = [5, 6, 7, 8]
  out = generate(policy.model, [prompt], [3], SamplingParams(max_new_tokens=5))[0]
  seq = jax.numpy.asarray([prompt + out.tokens.tolist()])
  logits = forward(policy.model, seq)[0, len(prompt) - 1:-1]
  want = jax.nn.log_softmax(logits, axis=-1)[np.arange(5), out.tokens]
  np.testing.assert_allclose(out.logprobs, want, atol=1e-4)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_fingerprinted_updates_are_checked_on_device_without_pulling(versions, fmt, monkeypatch):
  policy = HeldPolicy(UNTIED, fmt, on_device_checks=True)
  pulled, printed, pull = [], [], policy._pulled_checksum
  monkeypatch.setattr(policy, "_pulled_checksum", lambda name: pulled.append(name) or pull(name))

  real = weights.fingerprints_of

  def counted(state):
    printed.append(sorted(state))
    return real(state)

  monkeypatch.setattr(weights, "fingerprints_of", counted)
  policy.apply(sync.encode(None, versions[0], fmt, version=0, fingerprints=True))
  assert printed == [policy.names]
  delta = sync.encode(versions[0], versions[1], fmt, version=1, fingerprints=True)
  policy.apply(sync.Update.from_bytes(delta.to_bytes()))
  assert policy.version == 1 and pulled == []
  want = sync.held_state(versions[1], fmt)
  assert all(same_bits(policy.held_state()[k], want[k]) for k in want)
  # Only the changed tensors were fingerprinted again; the others kept theirs.
  changed = sorted(k for k in delta.tensors if delta.changes(k).kind != "unchanged")
  assert changed and len(changed) < len(delta.tensors)
  assert printed[1] == changed
  # An update without fingerprints falls back to pulling and hashing (every tensor: none
  # has a checksum yet).
  policy.apply(sync.encode(versions[1], versions[2], fmt, version=2))
  assert sorted(pulled) == policy.names and policy.version == 2


def test_a_bad_device_tensor_fails_the_fingerprint_seal_and_names_it(versions):
  policy = HeldPolicy(UNTIED, "bf16", on_device_checks=True)
  policy.apply(sync.encode(None, versions[0], "bf16", version=0, fingerprints=True))
  delta = sync.encode(versions[0], versions[1], "bf16", version=1, fingerprints=True)
  name = next(n for n in delta.tensors if delta.changes(n).kind == "sparse")
  var = policy._vars[name]
  var.set_value(var[...].at[(0,) * var[...].ndim].add(1))  # one element went bad
  with pytest.raises(ResyncNeeded, match=f"{name}.*fingerprint"):
    policy.apply(delta)
  assert policy.version is None
  # verify_all after a restart checks on device too, and names an unchanged bad tensor.
  policy.apply(sync.encode(None, versions[1], "bf16", version=1, fingerprints=True))
  policy.verify_all(sync.encode(versions[0], versions[1], "bf16", version=1, fingerprints=True))
  other = next(n for n in delta.tensors if delta.changes(n).kind == "unchanged")
  bad = policy._vars[other]
  bad.set_value(-bad[...])
  with pytest.raises(sync.CodecError, match=f"{other}.*fingerprint"):
    policy.verify_all(delta)


def test_on_device_checks_default_to_pulling_on_the_cpu(versions):
  policy = HeldPolicy(UNTIED, "bf16")
  assert not policy._checks_on_device()  # no weights yet
  policy.apply(sync.encode(None, versions[0], "bf16", version=0, fingerprints=True))
  assert jax.default_backend() != "cpu" or not policy._checks_on_device()
  assert policy._checksums and not policy._fingerprints
  with pytest.raises(ValueError, match="on_device_checks"):
    HeldPolicy(UNTIED, "bf16", on_device_checks="yes")


def test_a_delta_is_one_scatter_and_like_sized_deltas_reuse_its_program(versions, monkeypatch):
  policy = HeldPolicy(UNTIED, "bf16")
  policy.apply(sync.encode(None, versions[0], "bf16", version=0))
  calls, real = [], patch._scatter
  monkeypatch.setattr(patch, "_scatter", lambda *a: calls.append(a[3]) or real(*a))
  for v in (1, 2):
    delta = sync.encode(versions[v - 1], versions[v], "bf16", version=v)
    policy.apply(delta)
    assert policy.version == v
  kinds = {n: delta.changes(n).kind for n in delta.tensors}
  assert "unchanged" in kinds.values()
  assert len(calls) == 2 and len(calls[0]) == len(kinds)  # every tensor in one call
  assert calls[0] == calls[1]  # the same capacities: the same compiled program
  want = sync.held_state(versions[2], "bf16")
  assert all(same_bits(policy.held_state()[k], want[k]) for k in want)


def test_held_bits_read_and_write_values():
  policy = HeldPolicy(UNTIED, "bf16")
  params = float_params(UNTIED, 4)
  policy.apply(sync.encode(None, params, "bf16", version=0))
  var = policy._vars["norm.scale"]
  assert isinstance(var, weights.HeldBits) and var.get_raw_value().dtype == np.uint16
  assert var[...].dtype == jax.numpy.bfloat16
  np.testing.assert_array_equal(np.asarray(var[...], np.float32),
                                params["norm.scale"].astype(BF16).astype(np.float32))
  var.set_value(var[...] * 2)
  assert var.get_raw_value().dtype == np.uint16
  np.testing.assert_array_equal(np.asarray(var[...], np.float32),
                                2 * params["norm.scale"].astype(BF16).astype(np.float32))
  var.set_value(params["norm.scale"] / 3)  # float32: rounded to bf16, held as its bits
  assert var.get_raw_value().dtype == np.uint16
  np.testing.assert_array_equal(np.asarray(var[...], np.float32),
                                (params["norm.scale"] / 3).astype(BF16).astype(np.float32))
