"""Weight sync codec: versioned keyframes and sparse deltas of bf16 or int8 weights.

numpy and numba only (no JAX, no gRPC): the parameter server validates and stores updates
with it; `rlax_ps.sync.patch` and `rlax_ps.sync.device` (imported on demand) apply them to JAX
arrays on device and fetch a publisher's changes from it.
The wire format is in FORMAT.md.

Formats:
  * "bf16": the held state is {name: bf16 array}; float targets are rounded to bf16.
  * "int8": {name: int8 codes, name + ".scale": bf16 scales} for every tensor of ndim >= 2
    but routers, and {name: bf16} for the rest; symmetric scales per output channel (per
    row of an embedding, per expert and output channel of an expert stack) (int8.py on the
    host, int8_device.py jitted and bit-identical on device).
  A keyframe carries every tensor raw. A delta codes, per tensor, the changed elements'
  positions and wrapping bit offsets (sparse.py, entropy-coded by entropy.py); small
  tensors of a dtype share one section (a pack); a tensor whose code would not be
  smaller than its bytes is sent raw.

Host usage:
  update = encode(prev, params, "bf16", version=v)      # prev=None: keyframe
  update = encode(prev, params, "bf16", version=v, base_checksums=last.checksums)
  wire = update.to_bytes(); update = Update.from_bytes(wire)   # CodecError if bad
  header = read_header(wire, held)  # versions, fmt, tensor metas; no payload decoding
  parts = keyframe_parts(params, "bf16", version=v)  # a keyframe as buffers (views): written
                                    # out a part at a time; read back with header_nbytes and
                                    # read_header(head, nbytes=...)
  update = encode(..., model=config.forward_fields())  # the header carries the model's
                                    # config fields: update.model, which workers check
  held = apply(held, update)        # new arrays, verified bit for bit against the seals
  held = apply(held, update, inplace=True)   # writes only the changed elements
  A delta names its tensors by the digest of its base's layout (names, shapes, dtypes):
  apply binds it to the base; elsewhere update.bind(held) or read_header(wire, held).

On device (workers, in place):
  ch = update.changes(name)         # TensorChanges: "unchanged", "replace" (ch.array) or
                                    # "sparse" (ch.indices, ch.offsets: new_bits[indices] =
                                    # old_bits[indices] + offsets, wrapping)
  rlax_ps.sync.patch.Patcher().apply(held_bits, update)  # a worker's held uint16/uint8
                                    # bits, patched in place: one donated jitted scatter
                                    # per group of tensors
  host, fps = rlax_ps.sync.device.publish_state(host_prev, prev_on_device, new_on_device)
  encode(host_prev, host, ..., fingerprints=fps)  # fetches only changed elements; seals
                                    # device fingerprints that workers check where their
                                    # weights are: update.check_fingerprints(...)

Checksums are xxh3-64 of each tensor's held bytes, recorded as seals (integrity.py): one
64-bit digest over all results, one over all bases (deltas), one over the sections, each
with a few locators that name the tensor behind a mismatch.
"""

from rlax_ps.sync.codec import apply, dequantize, encode, held_state, keyframe_parts
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.int8 import quantize_params
from rlax_ps.sync.integrity import Seal, checksum, state_digest
from rlax_ps.sync.wire import (PREFIX_BYTES, TensorChanges, TensorMeta, Update, UpdateHeader,
                               header_nbytes, read_header)

__all__ = [
    "PREFIX_BYTES", "CodecError", "Seal", "TensorChanges", "TensorMeta", "Update", "UpdateHeader",
    "apply", "checksum", "dequantize", "encode", "header_nbytes", "held_state", "keyframe_parts",
    "quantize_params", "read_header", "state_digest",
]
