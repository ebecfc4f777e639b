"""Weight sync codec: versioned keyframes and sparse deltas of bf16 or int8 weights.

Imports numpy and numba (compiled loops, loops.py; no JAX, no gRPC): the parameter server
validates and stores updates with it; `rlax_ps.sync.device` (imported on demand) applies them to JAX arrays on device.

Formats:
  * "bf16": the held state is {name: bf16 array}; float targets are rounded to bf16
    (nearest even). A delta codes, per tensor, which elements changed and each one's new
    bit pattern as a wrapping offset of the old one (tensor_codec.py: gap/bitmap/dense
    layouts with rANS, rans.py; joint.py: the one-pass Rice + Huffman layout of tensors
    of 64K+ elements; packs.py: one section for all small tensors of a dtype).
  * "int8": the held state is {name: int8 codes, name + ".scale": bf16 scales} for every
    tensor of ndim >= 2, and {name: bf16} for 1-D tensors; per-output-channel symmetric
    scales (last axis of a kernel [in, out]; one per row of an "...embedding" table).
    See int8.py for the exact quantizer (int8_loops.py on the host, int8_device.py jitted
    and bit-identical on device, for a trainer that quantizes before the copy to the host).
    `encode` takes float weights (quantizing both sides deterministically) or a held
    state; `apply` takes and returns the held state.
    A delta codes changed codes and changed scales exactly like bf16 elements.

Host usage:
  update = encode(prev, params, "bf16", version=v)      # prev=None: keyframe
  update = encode(prev, params, "bf16", version=v, base_checksums=last.checksums)
                                    # a publisher's next delta: the base is not hashed again
  wire = update.to_bytes(); update = Update.from_bytes(wire)   # CodecError if bad
  header = read_header(wire)        # versions, fmt, tensor metas; no payload decoding
  for c in update.chunks(1 << 20): ...; Reassembler().feed(c) -> Update on the last chunk
  held = apply(held, update)        # verified bit for bit against the update's seals
  spare = spare_state(held)         # the other half of a double buffer (its own arena)
  new = apply(held, update, out=spare)  # into that spare: no allocation, no page faults;
                                    # inplace=True writes changed elements into held
  encode(..., threads=16); apply(..., threads=16)   # tensors side by side (parallel.py;
                                    # default: the host's cores, at most 8; same bytes)
  A held state made here (held_state of float weights, apply's new arrays) is one buffer;
  once none of its arrays is referenced the buffer is kept for the next state of that
  size (at most arena.SPARES of them; rlax_ps.sync.arena.release_spares() frees them).

On-device usage (workers, in place, without the base on the host):
  ch = update.changes(name)         # TensorChanges
    ch.kind == "sparse":  ch.indices (flat int64), ch.offsets (uint16 for bf16, uint8 for
                          int8): new_bits[indices] = old_bits[indices] + offsets (wrapping);
                          with a host base, update.changes(name, base).values are the new
                          values in the held dtype.
    ch.kind == "dense":   ch.offsets for every element, same rule.
    ch.kind == "replace": ch.array is the new array; "unchanged": nothing to do.
  rlax_ps.sync.device.apply_changes(buf, ch) does this with a donated jitted scatter;
  rlax_ps.sync.device.padded_changes(update, name) is the TensorChanges it takes as they
  are (int32 indices padded to a power of two, decoded straight into them: a worker's path);
  a publisher whose held state lives on device keeps a host copy current with
  rlax_ps.sync.device.host_state(host_prev, prev_on_device, new_on_device), which fetches
  only the changed elements (then encodes host_prev -> the result on the host);
  update.verify_all({name: array or checksum(array)}) checks the whole result at once
  (a worker keeps the checksums of tensors an update leaves unchanged);
  host, fps = rlax_ps.sync.device.publish_state(host_prev, prev_on_device, new_on_device)
  then encode(host_prev, host, ..., fingerprints=fps) also seals device fingerprints
  (fingerprints.py), which workers check where their weights are:
  update.check_fingerprints(rlax_ps.sync.device.fingerprints_of(held)), no pull.

Checksums are xxh3-64 of each tensor's exact held bytes (several times zlib.crc32's
speed, which would cost more than the whole rest of a sparse apply). An update
records them as seals (integrity.py): one 64-bit digest over all results, one over all
bases (deltas), one over the sections, each with a few group locators that name the
tensor behind a mismatch.
"""

from rlax_ps.sync.codec import apply, dequantize, encode, held_state, spare_state
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.int8 import quantize_params
from rlax_ps.sync.integrity import Seal, checksum, state_digest
from rlax_ps.sync.wire import (Reassembler, TensorChanges, TensorMeta, Update, UpdateHeader,
                               read_header)

__all__ = [
    "CodecError", "Reassembler", "Seal", "TensorChanges", "TensorMeta", "Update", "UpdateHeader",
    "apply", "checksum", "dequantize", "encode", "held_state", "quantize_params", "read_header",
    "spare_state", "state_digest",
]
