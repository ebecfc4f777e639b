"""Held states in one buffer (arena.py): packs back to back, read and written as one span."""

import gc
import weakref

import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync import arena, codec, int8, loops, packs
from rlax_ps.sync.bits import BF16, INT8, round_into, to_bf16
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


def test_a_span_record_holds_the_other_members_but_not_the_first():
  """The record refuses a pack with any member replaced, and does not keep the first
  array alive: dropping it alone forgets the span, while the others still live."""
  held = sync.held_state(float_model(np.random.default_rng(3)), "bf16")
  members = next(iter(packs.members_by_dtype({n: a.size for n, a in held.items()},
                                             {n: a.dtype for n, a in held.items()}).values()))
  arrays = [held[n] for n in members]
  assert len(arrays) >= 3 and arena.span_of(arrays) is not None
  assert arena.span_of(tuple(arrays)) is not None  # any sequence of the same objects
  middle = arrays[:1] + [arrays[1].copy()] + arrays[2:]
  assert arena.span_of(middle) is None
  first, key = weakref.ref(arrays[0]), id(arrays[0])
  del held[members[0]], arrays[0], middle
  gc.collect()
  assert first() is None and key not in arena._PACKS
  assert all(a.base is not None for a in arrays)  # the others live on


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


def test_float32_rounding_equals_astype_on_every_high_half_and_the_rounding_cases():
  """The compiled float32 rounding (held_state's and to_bf16's path) against ml_dtypes'
  astype: every bf16 pattern as the high half (NaNs, infinities, subnormals, both zeros)
  under the low halves that decide rounding (0, 1, below, at and above the tie, all ones)
  and random ones; a strided float32 and a float64 tensor take numpy's cast, C-ordered."""
  rng = np.random.default_rng(5)
  high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
  lows = np.concatenate([np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32),
                         rng.integers(0, 1 << 16, 4, dtype=np.uint32)])
  w = (high[:, None] | lows[None, :]).reshape(-1).view(np.float32)
  out = np.empty(w.shape, BF16)
  with np.errstate(invalid="ignore"):  # NaN casts warn in astype
    round_into(out, w)
    assert np.array_equal(out.view(np.uint16), w.astype(BF16).view(np.uint16))
    strided = w.reshape(-1, 10)[:, ::3]
    wide = w[:5000].astype(np.float64)
    for name, x in (("strided", strided), ("wide", wide), ("scalar", w[7].reshape(()))):
      got = to_bf16(name, x)
      assert got.flags.c_contiguous and got.shape == x.shape, name
      assert np.array_equal(got.view(np.uint16), x.astype(BF16).view(np.uint16)), name


@pytest.mark.slow
def test_float32_rounding_equals_astype_on_all_float32_patterns():
  """loops.round_bf16_bits against ml_dtypes' astype over all 2^32 float32 bit patterns
  (under a minute on two cores)."""
  chunk = 1 << 26
  ours, theirs = np.empty(chunk, np.uint16), np.empty(chunk, np.uint16)
  with np.errstate(invalid="ignore"):  # NaN casts warn in astype
    for start in range(0, 1 << 32, chunk):
      src = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32)
      loops.round_bf16_bits(src, ours)
      theirs[:] = src.view(np.float32).astype(BF16).view(np.uint16)
      assert np.array_equal(ours, theirs), hex(start + int(np.argmax(ours != theirs)))


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


def test_a_tensor_meta_knows_its_size_and_is_immutable():
  made = TensorMeta("w", (3, 4), BF16, "joint", 10, 20)
  assert made == TensorMeta("w", (3, 4), BF16, "joint", 10, 20, 12)
  assert made.size == 12 and made.offset == 20 and made.nbytes == 10
  assert TensorMeta("b", (), BF16, "raw").size == 1
  assert made._replace(mode="raw").mode == "raw" and made.mode == "joint"
  with pytest.raises(AttributeError):
    made.mode = "raw"


def _arena_of(held):
  """The lowest address among a held state's arrays: where its arena's pieces start."""
  return min(address(a) for a in held.values())


def test_a_freed_arena_is_reused_only_once_no_array_of_it_remains():
  """An arena's memory becomes a spare when the last array cut from it goes (a view the
  caller made included), and the next arena of that size takes it."""
  arena.release_spares()
  shapes = {"a": (64, 32), "b": (48,), "c": (40,)}
  dtypes = dict.fromkeys(shapes, BF16)
  first = arena.held_arena(shapes, dtypes)
  at = _arena_of(first)
  kept = first["a"][3:].T  # the caller's own view of one array
  member = first["c"]  # a pack member
  del first
  other = arena.held_arena(shapes, dtypes)
  assert _arena_of(other) != at  # still referenced: not reused
  del kept
  again = arena.held_arena(shapes, dtypes)
  assert _arena_of(again) != at  # the pack member still holds it
  del member
  gc.collect()
  reused = arena.held_arena(shapes, dtypes)
  assert _arena_of(reused) == at
  del other, again, reused
  assert arena.release_spares() > 0
  assert arena.release_spares() == 0


def test_at_most_spares_buffers_are_kept_and_release_returns_their_bytes():
  """The most recently freed SPARES buffers are kept; release_spares returns their bytes."""
  arena.release_spares()
  lengths = [1000 * (i + 1) for i in range(arena.SPARES + 2)]
  for n in lengths:
    held = arena.held_arena({"w": (n,)}, {"w": BF16})
    del held
  kept = lengths[-arena.SPARES:]
  assert arena.release_spares() == sum(arena._aligned(n, BF16) + arena.ALIGN for n in kept)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_apply_into_a_reused_arena_still_equals_the_target(fmt):
  """apply's second result lands in the first one's freed memory (stale contents) and is
  still exactly the target."""
  arena.release_spares()
  rng = np.random.default_rng(7)
  params = float_model(rng)
  base, target = sync.held_state(params, fmt), sync.held_state(stepped(params, rng), fmt)
  update = sync.encode(base, target, fmt, version=1, threads=1)
  first = sync.apply(base, sync.Update.from_bytes(update.to_bytes()), threads=1)
  at = _arena_of(first)
  for a in first.values():
    a.view(np.uint8)[...] = 0x5A  # what a reuse must overwrite
  del first, a
  second = sync.apply(base, sync.Update.from_bytes(update.to_bytes()), threads=1)
  assert _arena_of(second) == at
  for name, want in target.items():
    np.testing.assert_array_equal(second[name].view(np.uint8), want.view(np.uint8), name)


def test_bf16_held_states_pass_through_and_others_are_made_c_ordered_bf16():
  """A C-ordered bf16 state is held as it is (the same arrays); a Fortran-ordered tensor is
  copied to C order, and the float tensors of a partly bf16 state are rounded."""
  params = float_model(np.random.default_rng(3))
  held = sync.held_state(params, "bf16")
  again = sync.held_state(held, "bf16")
  assert all(again[name] is held[name] for name in held)
  fortran = dict(held, **{"big.kernel": np.asfortranarray(held["big.kernel"])})
  partly = dict(held, **{"embed.embedding": params["embed.embedding"]})
  for state, name in ((fortran, "big.kernel"), (partly, "embed.embedding")):
    out = sync.held_state(state, "bf16")
    assert out[name].dtype == BF16 and out[name].flags.c_contiguous, name
    np.testing.assert_array_equal(out[name].view(np.uint16), held[name].view(np.uint16))


def test_an_arena_no_longer_tracked_keeps_its_memory_while_its_arrays_live():
  """Past KEEP newer arenas an arena is no longer tracked, and its arrays still own the
  memory: freed and reused by other allocations, it would change under them."""
  arena.release_spares()
  shapes, dtypes = {"w": (16, 1024)}, {"w": BF16}  # 32 KB: below glibc's mmap threshold
  first = arena.held_arena(shapes, dtypes)
  first["w"].view(np.uint16)[...] = 0x1234
  others = [arena.held_arena(shapes, dtypes) for _ in range(arena.KEEP + 2)]
  assert not any(e[2] is first["w"].base for e in arena._ARENAS)  # no longer tracked
  del others
  gc.collect()
  litter = [np.full(16 * 1024, 0x4321, np.uint16) for _ in range(64)]  # reuse freed memory
  assert np.all(first["w"].view(np.uint16) == 0x1234)
  del litter


def test_free_arenas_past_spares_are_dropped_the_oldest_first():
  """Arenas of several sizes freed in turn: at most SPARES free ones stay tracked, the
  most recent, and a state in use among them is never dropped for being free."""
  arena.release_spares()
  held = arena.held_arena({"w": (500,)}, {"w": BF16})
  for n in range(1000, 1000 + 100 * (arena.KEEP + 3), 100):
    arena.held_arena({"w": (n,)}, {"w": BF16})  # made and freed at once
  free = [e for e in arena._ARENAS if arena._free(e)]
  assert len(free) == arena.SPARES
  assert [e[0].size for e in free] == sorted(e[0].size for e in free)  # the newest kept
  assert arena.release_spares() == sum(e[0].size for e in free)
  assert held["w"].size == 500


def small_model(rng):
  """float_model without its large tensor: every tensor packed (codec's one-call paths)."""
  return {n: w for n, w in float_model(rng).items() if n != "big.kernel"}


def bits_equal(got, want):
  return all(np.array_equal(got[n].view(np.uint8), want[n].view(np.uint8)) for n in want)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_state_record_finds_a_held_state_by_identity_and_refuses_any_other(fmt):
  """A held state is found with its layout key and packs' spans: in another dict of the
  same arrays too, but not once a name, an array or the order differs."""
  held = sync.held_state(float_model(np.random.default_rng(7)), fmt)
  key, spans = arena.state_record(held)
  assert key == tuple((n, a.shape, a.dtype) for n, a in held.items())
  groups = packs.members_by_dtype({n: a.size for n, a in held.items()},
                                  {n: a.dtype for n, a in held.items()})
  assert len(spans) == len(groups) > 0
  for span, members in zip(spans, groups.values()):
    assert span is arena.span_of([held[n] for n in members])
  assert arena.state_record(dict(held))[0] is key
  names = list(held)
  renamed = {("x." + n if n == names[1] else n): a for n, a in held.items()}
  replaced = {**held, names[2]: held[names[2]].copy()}
  reordered = dict(reversed(list(held.items())))
  fewer = dict(list(held.items())[:-1])
  for other in (renamed, replaced, reordered, fewer, {}):
    assert arena.state_record(other) is None


def test_a_state_record_goes_with_its_anchor_and_holds_no_state_alive():
  """Dropping a held state frees all its arrays by reference counts alone (the records
  form no cycle), and its record with them; dropping the anchor alone forgets it too."""
  held = sync.held_state(small_model(np.random.default_rng(8)), "bf16")
  first = id(next(iter(held.values())))
  assert first in arena._STATES
  refs = [weakref.ref(a) for a in held.values()]
  del held
  assert all(r() is None for r in refs) and first not in arena._STATES
  held = sync.held_state(float_model(np.random.default_rng(8)), "int8")
  names = tuple(held)
  groups = packs.members_by_dtype({n: a.size for n, a in held.items()},
                                  {n: a.dtype for n, a in held.items()})
  anchor = names[arena.anchor_of(names, groups.values())]
  rest = {n: a for n, a in held.items() if n != anchor}
  first = id(next(iter(held.values())))
  del held
  assert first not in arena._STATES  # the anchor went with the dict
  assert all(a.base is not None for a in rest.values())  # the others live on


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("model", [small_model, float_model])
def test_recorded_states_code_and_apply_as_unrecorded_copies_do(fmt, model):
  """encode and apply read a recorded state's layout and spans from its record: the same
  bytes and results as from copies of its arrays (read array by array); a small model's
  apply records its new state, which then codes the next update as a held state does."""
  rng = np.random.default_rng(9)
  params = model(rng)
  base, target = sync.held_state(params, fmt), sync.held_state(stepped(params, rng), fmt)
  plain = lambda state: {n: a.copy() for n, a in state.items()}
  assert arena.state_record(plain(base)) is None
  update = sync.encode(base, target, fmt, version=1, threads=1)
  assert update.to_bytes() == sync.encode(plain(base), plain(target), fmt, version=1,
                                          threads=1).to_bytes()
  got = sync.apply(base, sync.Update.from_bytes(update.to_bytes()), threads=1)
  loose = sync.apply(plain(base), sync.Update.from_bytes(update.to_bytes()), threads=1)
  assert bits_equal(got, target) and bits_equal(loose, target)
  if model is small_model:
    key, spans = arena.state_record(got)
    assert key == tuple((n, a.shape, a.dtype) for n, a in got.items())
    for span, members in zip(spans, update.packs().values()):
      assert span is arena.span_of([got[n] for n in members])
  after = sync.held_state(stepped(params, rng), fmt)
  assert (sync.encode(got, after, fmt, version=2, threads=1).to_bytes()
          == sync.encode(plain(got), after, fmt, version=2, threads=1).to_bytes())


def test_a_recorded_state_of_other_shapes_is_still_named_as_the_misfit():
  """A recorded base whose layout is not the target's or the update's takes the checks
  that name the tensor: a record is never taken for another layout."""
  rng = np.random.default_rng(10)
  params = small_model(rng)
  other = dict(params, **{"embed.embedding": params["embed.embedding"][:-1]})
  base = sync.held_state(params, "bf16")
  with pytest.raises(sync.CodecError, match="'embed.embedding'"):
    sync.encode(base, sync.held_state(other, "bf16"), "bf16", version=1)
  update = sync.encode(sync.held_state(other, "bf16"),
                       sync.held_state(stepped(other, rng), "bf16"), "bf16", version=1)
  with pytest.raises(sync.CodecError, match="'embed.embedding'"):
    sync.apply(base, sync.Update.from_bytes(update.to_bytes()))


def test_spans_lie_in_order_in_one_arena_each_aligned():
  pieces = ((1000, BF16), (37, INT8), (5, BF16))
  got = arena.spans(pieces)
  assert [(a.size, a.dtype) for a in got] == [(1000, np.dtype(np.uint16)),
                                              (37, np.dtype(np.uint8)),
                                              (5, np.dtype(np.uint16))]
  starts = [address(a) for a in got]
  assert all(s % arena.ALIGN == 0 for s in starts) and starts == sorted(starts)
  assert all(starts[i] + got[i].nbytes <= starts[i + 1] for i in range(len(got) - 1))
  assert len({id(a.base) for a in got}) == 1 and got[0].base is not None
  for i, a in enumerate(got):
    a[:] = i + 1
  assert [set(a.tolist()) for a in got] == [{1}, {2}, {3}]  # no piece overlaps another


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_recorded_spare_is_written_through_its_spans_and_returned(fmt, monkeypatch):
  """apply(..., out=spare_state(base)) of a small model, both states recorded (spare_state:
  zeros of the base's layout in an arena of its own): the result is decoded
  straight into the spare's spans (no per-tensor slot or check) and the spare's own arrays
  come back; a spare not recorded, or one in the base's arena, is checked tensor by tensor
  as before (the base itself: named as sharing its memory)."""
  rng = np.random.default_rng(13)
  params = small_model(rng)
  base = sync.held_state(params, fmt)
  target = sync.held_state(stepped(params, rng), fmt)
  update = sync.Update.from_bytes(sync.encode(base, target, fmt, version=1).to_bytes())
  checked = []
  real = codec._out_slots
  monkeypatch.setattr(codec, "_out_slots", lambda *a: checked.append(1) or real(*a))
  spare = sync.spare_state(base)
  assert [(n, a.shape, a.dtype) for n, a in spare.items()] == [
      (n, a.shape, a.dtype) for n, a in base.items()]
  assert not any(np.shares_memory(spare[n], base[n]) or spare[n].any() for n in base)
  ids = {n: id(a) for n, a in spare.items()}
  got = sync.apply(base, update, out=spare, threads=1)
  assert {n: id(a) for n, a in got.items()} == ids and bits_equal(got, target)
  assert not checked and arena.state_record(got) is not None
  loose = {n: np.zeros_like(a) for n, a in base.items()}
  assert bits_equal(sync.apply(base, update, out=loose, threads=1), target) and checked
  with pytest.raises(sync.CodecError, match="shares memory with the base"):
    sync.apply(base, update, out=base)
