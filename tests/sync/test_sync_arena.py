"""Held states in one buffer (arena.py): packs back to back, read and written as one span."""

import gc

import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync import arena, int8, packs
from rlax_ps.sync.bits import BF16, INT8
from rlax_ps.sync.wire import TensorMeta


def float_model(rng):
  params = {f"layers.{i}.norm.scale": 1 + rng.standard_normal(48).astype(np.float32) * 0.01
            for i in range(3)}
  params |= {f"layers.{i}.attn.q.kernel": rng.standard_normal((16, 24)).astype(np.float32)
             for i in range(3)}
  params["embed.embedding"] = rng.standard_normal((40, 16)).astype(np.float32)
  params["big.kernel"] = rng.standard_normal((packs.PACK_BELOW // 64, 64)).astype(np.float32)
  return params


def address(a: np.ndarray) -> int:
  return a.__array_interface__["data"][0]


def stepped(params, rng, share=0.05):
  out = {}
  for name, w in params.items():
    step = rng.standard_normal(w.shape).astype(np.float32) * 1e-3
    out[name] = w + step * (rng.random(w.shape) < share)
  return out


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_held_state_lays_each_pack_back_to_back_and_registers_its_span(fmt):
  held = sync.held_state(float_model(np.random.default_rng(0)), fmt)
  groups = packs.members_by_dtype({n: a.size for n, a in held.items()},
                                  {n: a.dtype for n, a in held.items()})
  assert set(groups) == ({BF16} if fmt == "bf16" else {BF16, INT8})
  for members in groups.values():
    arrays = [held[n] for n in members]
    for a, b in zip(arrays, arrays[1:]):
      assert address(b) == address(a) + a.nbytes
    span = arena.span_of(arrays)
    assert span is not None and address(span) == address(arrays[0])
    assert np.array_equal(span, np.concatenate([a.reshape(-1) for a in arrays]).view(span.dtype))
    assert arena.span_of(arrays[:-1]) is None  # exactly the registered arrays, in order
    assert arena.span_of(arrays[::-1]) is None
    assert arena.span_of([arrays[0].copy()] + arrays[1:]) is None
  assert address(held["big.kernel"]) % arena.ALIGN == 0


def test_a_span_is_forgotten_with_its_first_array():
  held = sync.held_state(float_model(np.random.default_rng(1)), "bf16")
  members = next(iter(packs.members_by_dtype({n: a.size for n, a in held.items()},
                                             {n: a.dtype for n, a in held.items()}).values()))
  key = id(held[members[0]])
  assert key in arena._PACKS
  del held
  gc.collect()
  assert key not in arena._PACKS


def test_bf16_held_state_rounds_every_float32_pattern_as_astype():
  rng = np.random.default_rng(2)
  bits = rng.integers(0, 1 << 32, 5000, dtype=np.uint64).astype(np.uint32)
  special = np.array([0x7FC00001, 0xFFC12345, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001,
                      0x007FFFFF, 0x3F808000, 0x3F818000, 0x7F7FFFFF], np.uint32)
  w = np.concatenate([bits, special]).view(np.float32)
  params = {"a.scale": w[:100], "b.kernel": w[100:].reshape(-1, 10), "c.bias": w[:7]}
  with np.errstate(invalid="ignore"):  # NaN casts warn, as astype does
    held = sync.held_state(params, "bf16")
    for name, x in params.items():
      assert np.array_equal(held[name].view(np.uint16), x.astype(BF16).view(np.uint16)), name


def test_int8_held_state_equals_the_quantizer_tensor_by_tensor():
  params = float_model(np.random.default_rng(3))
  held = sync.held_state(params, "int8")
  for name, w in params.items():
    if int8.layout(name, w.ndim) == "bf16":
      assert np.array_equal(held[name].view(np.uint16), w.astype(BF16).view(np.uint16))
      continue
    codes, scale = int8.quantize_tensor(name, w)
    assert np.array_equal(held[name], codes) and held[name].dtype == INT8
    assert np.array_equal(held[name + ".scale"].view(np.uint16), scale.view(np.uint16))
  with pytest.raises(sync.CodecError, match="'x.kernel'"):
    sync.held_state({"x.kernel": np.ones((2, 2), np.int32)}, "int8")


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_spans_and_concatenations_code_the_same_bytes_and_apply_registers_its_packs(fmt):
  rng = np.random.default_rng(4)
  params = float_model(rng)
  base, target = sync.held_state(params, fmt), sync.held_state(stepped(params, rng), fmt)
  loose_base = {n: a.copy() for n, a in base.items()}  # one buffer each: concatenated
  loose_target = {n: a.copy() for n, a in target.items()}
  update = sync.encode(base, target, fmt, version=1, threads=1)
  assert update.packs()  # the small tensors are packed, from spans
  assert (sync.encode(loose_base, loose_target, fmt, version=1, threads=1).to_bytes()
          == update.to_bytes())
  parsed = sync.Update.from_bytes(update.to_bytes())
  out = sync.apply(base, parsed, threads=1)
  loose_out = sync.apply(loose_base, parsed, threads=1)
  for name in target:
    assert np.array_equal(out[name].view(np.uint8), target[name].view(np.uint8)), name
    assert np.array_equal(loose_out[name].view(np.uint8), target[name].view(np.uint8)), name
  for members in parsed.packs().values():
    assert arena.span_of([out[n] for n in members]) is not None
  again = sync.encode(out, target, fmt, version=2, threads=1)  # from apply's spans
  assert all(meta.mode == "unchanged" for meta in again.tensors.values())


def test_tensor_meta_make_equals_the_dataclass():
  made = TensorMeta.make("w", (3, 4), BF16, "joint", 10, 20)
  assert made == TensorMeta("w", (3, 4), BF16, "joint", 10, 20)
  assert made.size == 12 and made.offset == 20
  with pytest.raises(AttributeError):
    made.mode = "raw"
