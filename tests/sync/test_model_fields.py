"""Every publication can carry its model's config fields (ModelConfig.forward_fields) in the
sync header, keyframes and deltas, bf16 and int8, stored and served as published; an update
without them (an older publication) reads and applies as before."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from param_server.weights import WeightStore
from rlax_ps import sync
from rlax_ps.models.config import ModelConfig
from rlax_ps.sync import wire
from rlax_ps.sync.bits import bit_view
from rlax_ps.train import publisher as publisher_lib

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2)
FIELDS = CONFIG.forward_fields()
# A keyframe (v0) and a delta (v1) of {"norm": linspace(-1, 1, 4), "w": arange(8)/3 as
# [2, 4]}, then "w" times 1.5, as rlax-ps wrote them before updates carried model fields.
OLD_KEYFRAME = bytes.fromhex(
    "524c585704002f00000061cd4146202a5101000001000200046e6f726d0001040001770002020408102e7d02"
    "d50cc881d671c02e7d02d50cc881d671c080bfabbeab3e803f0000ab3e2b3f803fab3fd53f00401540")
OLD_DELTA = bytes.fromhex(
    "524c5857040033000000ec49b97c202e7101000000010068ab2fb00917e382020001100000fae7c9ea04f2"
    "78eb71742e7d02d50cc881d671c074b145a5e64968240000003f803fc03f0040204040406040")


def _weights(step: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  w = rng.standard_normal((64, 32)).astype(np.float32)
  return {"w": np.where(rng.random(w.shape) < 0.1 * step, w * 1.5, w),
          "norm": np.ones(32, np.float32)}


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_keyframes_and_deltas_carry_the_model_fields(fmt):
  keyframe = sync.encode(None, _weights(0), fmt, version=0, model=FIELDS)
  delta = sync.encode(_weights(0), _weights(1), fmt, version=1, model=FIELDS)
  for update in (keyframe, delta):
    assert sync.read_header(update.to_bytes()).model == FIELDS
  parsed = [sync.Update.from_bytes(u.to_bytes()) for u in (keyframe, delta)]
  assert [u.model for u in parsed] == [FIELDS, FIELDS]
  held = sync.apply(sync.apply(None, parsed[0]), parsed[1])
  want = sync.held_state(_weights(1), fmt)
  assert all(np.array_equal(bit_view(held[n]), bit_view(want[n])) for n in want)


def test_a_keyframe_written_a_part_at_a_time_carries_them_too():
  parts = sync.keyframe_parts(_weights(0), "int8", version=4, model=FIELDS)
  assert sync.Update.from_bytes(b"".join(bytes(memoryview(p)) for p in parts)).model == FIELDS


def test_a_publication_of_an_older_rlax_ps_applies_without_model_fields():
  keyframe, delta = sync.Update.from_bytes(OLD_KEYFRAME), sync.Update.from_bytes(OLD_DELTA)
  assert keyframe.model is None and delta.model is None
  held = sync.apply(sync.apply(None, keyframe), delta)
  np.testing.assert_array_equal(held["w"].astype(np.float32),
                                (np.arange(8, dtype=np.float32).reshape(2, 4) / 3 * 1.5)
                                .astype(held["w"].dtype).astype(np.float32))


def test_the_weight_store_keeps_the_bytes_and_their_model_fields(tmp_path):
  store = WeightStore(str(tmp_path), chunk_bytes=1 << 20)
  for update in (sync.encode(None, _weights(0), "int8", version=0, model=FIELDS),
                 sync.encode(_weights(0), _weights(1), "int8", version=1, model=FIELDS)):
    blob = update.to_bytes()
    writer = store.begin_publish(len(blob))
    writer.write(0, blob)
    info, _ = store.commit(writer)
    stored = store.read_range(info, store.open_array(info), 0, info.nbytes).tobytes()
    assert stored == blob and sync.read_header(stored).model == FIELDS


def test_model_fields_that_are_not_a_json_object_are_refused():
  with pytest.raises(ValueError, match="^model: expected a dict"):
    sync.encode(None, _weights(0), "bf16", version=0, model=["rope_theta", 1.0])
  with pytest.raises(ValueError, match="^model: expected JSON values"):
    sync.encode(None, _weights(0), "bf16", version=0, model={"rope_theta": float("nan")})


@pytest.mark.parametrize("written", [b"[1]", b"\xff{", b'{"a":'])
def test_a_header_whose_model_fields_are_not_a_json_object_is_a_codec_error(written,
                                                                            monkeypatch):
  monkeypatch.setattr(wire, "model_json", lambda model: written)
  parts = sync.keyframe_parts(_weights(0), "bf16", version=0, model=FIELDS)  # not parsed
  blob = b"".join(bytes(memoryview(p)) for p in parts)
  with pytest.raises(sync.CodecError, match="update header: model fields"):
    sync.Update.from_bytes(blob)


def test_a_publisher_given_its_model_sends_the_fields_with_every_keyframe():
  class Client:
    def __init__(self):
      self.sent = []

    def publish(self, blob, run=""):
      self.sent.append(blob)

  client = Client()
  publisher = publisher_lib.Publisher(client, "bf16", keyframe_every=5, model=CONFIG)
  for version in range(2):
    publisher.publish({"w": jnp.asarray(_weights(version)["w"])}, version)
  updates = [sync.Update.from_bytes(b) for b in client.sent]
  assert [u.is_keyframe for u in updates] == [True, False]
  assert [u.model for u in updates] == [FIELDS, None]  # a worker starts from a keyframe


def test_forward_fields_hold_what_changes_the_forward_pass_and_nothing_else():
  assert {"rope_theta", "rope_scaling", "rms_norm_eps", "num_heads", "head_dim",
          "num_kv_heads", "hidden_act", "sliding_window", "tie_word_embeddings",
          "lora_rank"} <= FIELDS.keys()
  assert not {"dtype", "param_dtype", "lora_dtype", "expert_parallel", "architecture",
              "max_position_embeddings"} & FIELDS.keys()
  same = CONFIG.replace(dtype="bfloat16", param_dtype="bfloat16", architecture="qwen2",
                        max_position_embeddings=128, lora_alpha=64.0)  # LoRA off: idle
  assert same.forward_fields() == FIELDS
  for changed in (dict(rope_theta=5.0), dict(rms_norm_eps=1e-5), dict(hidden_act="gelu_tanh"),
                  dict(sliding_window=16), dict(head_dim=16, num_heads=2),
                  dict(lora_rank=4, lora_alpha=64.0)):
    assert CONFIG.replace(**changed).forward_fields() != FIELDS, changed
  lora = CONFIG.replace(lora_rank=4)
  assert lora.replace(lora_alpha=64.0).forward_fields() != lora.forward_fields()


def test_forward_fields_are_json_values_and_keep_longropes_derived_context():
  llama3 = CONFIG.replace(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0,
                                            original_max_position_embeddings=32))
  fields = llama3.forward_fields()
  assert json.loads(json.dumps(fields)) == fields and fields["rope_scaling"]["factor"] == 8.0
  longrope = CONFIG.replace(rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 4,
                                              long_factor=[2.0] * 4,
                                              original_max_position_embeddings=32))
  assert longrope.forward_fields()["max_position_embeddings"] == 2048
  assert longrope.forward_fields()["rope_scaling"]["long_factor"] == [2.0] * 4
  assert "rope_long_factors" in longrope.forward_fields()
