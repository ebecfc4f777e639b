"""Packs: a delta's small tensors of one dtype share one section."""


import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync import pack_coder, packs, tensor_codec, wire
from rlax_ps.sync.bits import BF16
from rlax_ps.sync.integrity import checksum


def small_model(rng, n=12):
  base = {f"layers.{i}.norm.scale": (1 + rng.standard_normal(64) * 0.01).astype(BF16)
          for i in range(n)}
  base |= {f"layers.{i}.attn.q.kernel": (rng.standard_normal((16, 32)) * 0.02).astype(BF16)
           for i in range(n)}
  base["big.kernel"] = (rng.standard_normal(packs.PACK_BELOW) * 0.02).astype(BF16)
  target = {k: v.copy() for k, v in base.items()}
  for i, v in enumerate(target.values()):
    if i % 3:
      flat = v.reshape(-1).view(np.uint16)
      flat[rng.choice(flat.size, 3, replace=False)] += np.uint16(1)
  return base, target


@pytest.fixture(scope="module")
def model():
  base, target = small_model(np.random.default_rng(0))
  return base, target, sync.encode(base, target, version=2)


def test_small_tensors_of_a_dtype_share_one_section(model):
  base, _, update = model
  small = [n for n in base if n != "big.kernel"]
  modes = [update.tensors[n].mode for n in small]
  assert modes[0] not in ("packed", "unchanged") and update.tensors[small[0]].nbytes
  assert modes[1:] == ["packed"] * (len(small) - 1)
  assert all(update.tensors[n].nbytes == 0 for n in small[1:])
  assert update.tensors["big.kernel"].mode != "packed"  # PACK_BELOW elements: its own
  assert update.pack(small[5]) == small and update.pack("big.kernel") is None


def test_packed_updates_round_trip_apply_inplace_and_changes(model):
  base, target, update = model
  again = sync.Update.from_bytes(update.to_bytes())
  out = sync.apply(base, again)
  held = {k: v.copy() for k, v in base.items()}
  sync.apply(held, again, inplace=True)
  for k in target:
    assert np.array_equal(out[k].view(np.uint16), target[k].view(np.uint16)), k
    assert np.array_equal(held[k].view(np.uint16), target[k].view(np.uint16)), k
    ch = again.changes(k, base[k])
    want = np.flatnonzero(base[k].view(np.uint16) != target[k].view(np.uint16))
    if want.size == 0:
      assert ch.kind == "unchanged", k
    else:
      assert ch.kind == "sparse" and np.array_equal(ch.indices, want), k
      assert np.array_equal(ch.values.view(np.uint16),
                            target[k].reshape(-1).view(np.uint16)[want]), k


def test_a_pack_is_smaller_than_its_members_coded_alone(model):
  base, target, update = model
  small = [n for n in base if n != "big.kernel"]
  alone = sum(sync.encode({n: base[n]}, {n: target[n]}, version=2).tensors[n].nbytes
              for n in small)
  assert update.tensors[small[0]].nbytes < alone


def test_unchanged_small_tensors_make_no_pack_and_are_scanned_once(monkeypatch):
  base, _ = small_model(np.random.default_rng(1))
  calls = []
  scan, pack = tensor_codec.encode_section, pack_coder.encode
  monkeypatch.setattr(tensor_codec, "encode_section",
                      lambda old, new, *a, **k: calls.append(new.size) or scan(old, new, *a, **k))
  monkeypatch.setattr(pack_coder, "encode",  # a pack's one compiled call
                      lambda old, new, *a, **k: calls.append(new.size) or pack(old, new, *a, **k))
  update = sync.encode(base, base, version=2, threads=1)
  assert {m.mode for m in update.tensors.values()} == {"unchanged"}
  assert update.packs() == {}
  small = sum(v.size for n, v in base.items() if n != "big.kernel")
  assert sorted(calls) == sorted([small, base["big.kernel"].size])  # the pack, then the rest
  assert update.checksums == {n: checksum(v) for n, v in base.items()}
  held = {k: v.copy() for k, v in base.items()}
  out = sync.apply(held, sync.Update.from_bytes(update.to_bytes()), inplace=True)  # checks
  assert all(np.array_equal(out[k].view(np.uint16), base[k].view(np.uint16)) for k in base)
  held["layers.4.norm.scale"].view(np.uint16)[0] ^= 1  # a wrong base fails the base seal
  with pytest.raises(sync.CodecError, match="layers.4.norm.scale"):
    sync.apply(held, update, inplace=True)


def test_int8_codes_and_scales_form_one_pack_each():
  rng = np.random.default_rng(2)
  w = {f"l{i}.kernel": rng.standard_normal((32, 16)).astype(np.float32) * 0.02 for i in range(6)}
  w2 = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.002 for k, v in w.items()}
  update = sync.encode(w, w2, "int8", version=1)
  codes = [n for n in update.tensors if not n.endswith(".scale")]
  scales = [n for n in update.tensors if n.endswith(".scale")]
  assert update.pack(codes[1]) == codes and update.pack(scales[1]) == scales
  out = sync.apply(sync.held_state(w, "int8"), update)
  want = sync.held_state(w2, "int8")
  for k in want:
    assert np.array_equal(out[k].view(np.uint8 if out[k].dtype == np.int8 else np.uint16),
                          want[k].view(np.uint8 if want[k].dtype == np.int8 else np.uint16)), k


@pytest.mark.parametrize("name,mode", [("layers.3.norm.scale", "sparse"),
                                       ("big.kernel", "packed")])
def test_headers_whose_modes_break_the_pack_rules_are_rejected(model, name, mode):
  _, _, update = model
  metas = dict(update.header.tensors)
  metas[name] = metas[name]._replace(mode=mode)
  with pytest.raises(sync.CodecError, match=repr(name)[1:-1]):
    packs.read_packs(metas)


def test_a_corrupted_pack_section_names_its_head(model):
  base, _, update = model
  head = next(iter(base))
  data = bytearray(update.to_bytes())
  meta = update.tensors[head]
  data[meta.offset + meta.nbytes // 2] ^= 0x10
  with pytest.raises(sync.CodecError, match=repr(head)):
    sync.apply(base, sync.Update.from_bytes(bytes(data)))
  assert wire.read_header(bytes(data)).tensors[head].mode == meta.mode


def test_an_encoded_update_carries_the_header_its_bytes_parse_to(model):
  base, target, update = model
  assert wire.read_header(update.to_bytes()) == update.header
  assert update.packs() == sync.Update.from_bytes(update.to_bytes()).packs()  # encoder's
  assert update.packs() == {next(iter(base)): [n for n in base if n != "big.kernel"]}
  keyframe = sync.encode(None, target, version=3)
  assert wire.read_header(keyframe.to_bytes()) == keyframe.header


def pack_of(rng, count, size, density, periodic=False):
  """base, target of `count` bf16 tensors of `size` elements (one pack) with `density` of
  their elements changed by one ulp (a repeating 11-element pattern when periodic)."""
  base = {f"t{i:02d}.scale": (1 + rng.standard_normal(size) * 0.01).astype(BF16)
          for i in range(count)}
  target = {k: v.copy() for k, v in base.items()}
  for v in target.values():
    flat = v.view(np.uint16)
    if periodic:
      flat += np.resize(np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1], np.uint16), size)
    else:
      flat[rng.choice(size, int(size * density), replace=False)] += np.uint16(1)
  return base, target


@pytest.mark.parametrize("count,size,density,periodic,mode", [
    (6, 4000, 0.6, False, "dense"),
    (6, 4000, 0.0, True, "bitmap"),
    (6, 4000, 0.002, False, "sparse"),
    (17, packs.PACK_BELOW - 1, 0.05, False, "joint")])
def test_every_pack_layout_applies_to_the_members_in_place_and_into_new_arrays(
    count, size, density, periodic, mode):
  base, target = pack_of(np.random.default_rng(7), count, size, density, periodic)
  update = sync.Update.from_bytes(sync.encode(base, target, version=1).to_bytes())
  head = next(iter(base))
  assert update.tensors[head].mode == mode and update.pack(head) == list(base)
  out = sync.apply(base, update)
  # New arrays: the members lie back to back (copied in and decoded as one array).
  ends = [out[k].ctypes.data + out[k].nbytes for k in base]
  assert [out[k].ctypes.data for k in base][1:] == ends[:-1]
  spare = {k: np.zeros_like(v) for k, v in base.items()}
  into = sync.apply(base, update, out=spare)
  held = {k: v.copy() for k, v in base.items()}
  returned = sync.apply(held, update, inplace=True)
  for k in base:
    assert np.array_equal(out[k].view(np.uint16), target[k].view(np.uint16)), k
    assert np.array_equal(spare[k].view(np.uint16), target[k].view(np.uint16)), k
    assert np.array_equal(held[k].view(np.uint16), target[k].view(np.uint16)), k
    assert returned[k] is held[k] and into[k] is spare[k], k


@pytest.mark.parametrize("mode_of", ["joint", "sparse", "dense"])
def test_a_pack_decoded_over_its_concatenation_equals_it_decoded_member_by_member(mode_of):
  """Decoded.add_to (a pack's members back to back, as apply's new arrays hold them) and
  Decoded.apply_parts (members anywhere: out= and in place) make the same bits."""
  size, density = {"joint": (packs.PACK_BELOW - 1, 0.05), "sparse": (4000, 0.002),
                   "dense": (4000, 0.6)}[mode_of]
  base, target = pack_of(np.random.default_rng(11), 5, size, density)
  update = sync.Update.from_bytes(sync.encode(base, target, version=1).to_bytes())
  head = next(iter(base))
  assert update.tensors[head].mode == mode_of
  decoded = update.decoded(head)
  whole = np.concatenate([v.view(np.uint16) for v in base.values()])
  decoded.add_to(whole)
  parts = [v.view(np.uint16).copy() for v in base.values()]
  decoded.apply_parts(parts, packs.starts([p.size for p in parts]))
  assert np.array_equal(whole, np.concatenate([v.view(np.uint16) for v in target.values()]))
  assert np.array_equal(whole, np.concatenate(parts))
  assert packs.starts([3, 5, 2]) == [0, 3, 8]


def test_pack_encoding_does_not_depend_on_what_the_thread_encoded_before():
  """Packs and scans reuse per-thread buffers: leftovers of a larger, denser update must not
  leak into the next one (compared with a thread that encoded nothing before)."""
  import threading  # noqa: PLC0415
  rng = np.random.default_rng(8)
  big_base, big_target = pack_of(rng, 9, 30000, 0.3)
  base, target = pack_of(rng, 5, 999, 0.02)
  sync.encode(big_base, big_target, version=1)
  after_big = sync.encode(base, target, version=1).to_bytes()
  fresh = []
  thread = threading.Thread(
      target=lambda: fresh.append(sync.encode(base, target, version=1).to_bytes()))
  thread.start()
  thread.join()
  assert after_big == fresh[0]
  out = sync.apply(base, sync.Update.from_bytes(after_big))
  for k in base:
    assert np.array_equal(out[k].view(np.uint16), target[k].view(np.uint16)), k


def test_changes_of_a_packs_members_decode_the_pack_once(model, monkeypatch):
  base, target, update = model
  update = sync.Update.from_bytes(update.to_bytes())
  calls = []
  sparse = tensor_codec.Decoded.sparse
  monkeypatch.setattr(tensor_codec.Decoded, "sparse",
                      lambda self: calls.append(self.mode) or sparse(self))
  small = [n for n in base if n != "big.kernel"]
  for name in small:
    ch = update.changes(name)
    want = np.flatnonzero(base[name].view(np.uint16) != target[name].view(np.uint16))
    assert np.array_equal(ch.indices if ch.kind == "sparse" else [], want), name
  assert len(calls) == 1
