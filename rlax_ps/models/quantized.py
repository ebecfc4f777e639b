"""Quantized Hub weight formats, dequantized as a checkpoint is read.

MXFP4 (gpt-oss's experts: `*_blocks` and `*_scales`); FP8 weights beside their scales:
`quant_method: fp8` (DeepSeek-V3/R1, Kimi K2, Qwen3-*-FP8: `*_scale_inv`, one per
`weight_block_size` block or per tensor) and compressed-tensors' float-quantized format
(llm-compressor's FP8 checkpoints: `*_scale`, one per tensor, output channel,
group or block). We train in bf16/float32, so all are expanded once on load.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any, Mapping, Sequence

import ml_dtypes
import numpy as np

_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)

# safetensors' 8-bit float codes, which its numpy reader cannot return, under ml_dtypes' types.
FP8_TYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
             "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
             "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu)}
_FP8_WEIGHTS = {"float8_e4m3fn", "float8_e5m2"}  # numpy names, as headers are reported
_FP8_SCALES = {"float32", "bfloat16", "float16", "float8_e8m0fnu", "uint8"}
QUANTIZATION_FIELD = "quantization_config"


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
  """MXFP4 `blocks` [E, out, G, 16] uint8 and `scales` [E, out, G] uint8 -> weights
  [E, G * 32, out] (x @ W orientation) in `dtype`, one expert at a time (as transformers'
  convert_moe_packed_tensors, which the fixtures check)."""
  shape = mxfp4_shape((blocks.shape, str(blocks.dtype)), (scales.shape, str(scales.dtype)))
  e, out, g, _ = blocks.shape
  result = np.empty(shape, dtype)
  for i in range(e):
    codes = np.stack([blocks[i] & 0x0F, blocks[i] >> 4], axis=-1).reshape(out, g, 32)
    values = np.ldexp(_FP4_VALUES[codes], scales[i].astype(np.int32)[..., None] - 127)
    result[i] = values.reshape(out, g * 32).T.astype(dtype)
  return result


def quantize_mxfp4(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Weights [E, in, out] (x @ W orientation) -> MXFP4 (`blocks` [E, out, in / 32, 16] uint8,
  `scales` [E, out, in / 32] uint8), dequantize_mxfp4's inverse up to rounding: each block
  of 32 inputs shares the power of two 2^(scale - 127) that brings its largest magnitude to
  at most 6 (E2M1's largest), and each value takes the nearest E2M1 code (ties to the even
  one), so that no value is clipped. One expert at a time."""
  w = np.asarray(weights)
  if w.ndim != 3 or w.shape[1] % 32:
    raise ValueError(f"MXFP4: expected weights [E, in, out] with in a multiple of 32, got "
                     f"{w.shape}")
  e, n, out = w.shape
  blocks = np.empty((e, out, n // 32, 16), np.uint8)
  scales = np.empty((e, out, n // 32), np.uint8)
  magnitudes = _FP4_VALUES[:8]
  midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
  for i in range(e):
    x = w[i].astype(np.float32).T.reshape(out, n // 32, 32)
    amax = np.abs(x).max(axis=-1)
    mantissa, exponent = np.frexp(np.where(amax > 0, amax / 6.0, 1.0))  # 2^exponent >= it
    exponent = np.clip(exponent - (mantissa == 0.5), -127, 127)
    a = np.abs(x) / np.ldexp(np.float32(1), exponent)[..., None]
    low, high = (np.searchsorted(midpoints, a, side=side) for side in ("left", "right"))
    code = np.where((low != high) & (low % 2 == 1), high, low)  # a tie: the even code
    code = code.astype(np.uint8) | (np.signbit(x).astype(np.uint8) << 3)
    blocks[i] = code[..., 0::2] | (code[..., 1::2] << 4)
    scales[i] = (exponent + 127).astype(np.uint8)
  return blocks, scales


def mxfp4_shape(blocks: tuple[Sequence[int], str], scales: tuple[Sequence[int], str]
                ) -> tuple[int, ...]:
  """The shape [E, G * 32, out] that MXFP4 `blocks` and `scales` (each as (shape, numpy
  dtype name)) dequantize to; a ValueError unless they are uint8 [E, out, G, 16] and
  [E, out, G]. Shapes alone, so that a header can be checked without reading data."""
  (b, b_dtype), (s, s_dtype) = (tuple(blocks[0]), blocks[1]), (tuple(scales[0]), scales[1])
  if (b_dtype, s_dtype) != ("uint8", "uint8") or len(b) != 4 or b[:-1] != s or b[-1] != 16:
    raise ValueError(f"MXFP4: expected uint8 blocks [E, out, G, 16] and scales [E, out, G], "
                     f"got {b_dtype} {b} and {s_dtype} {s}")
  return (b[0], b[2] * 32, b[1])


@dataclasses.dataclass(frozen=True)
class Fp8Layout:
  """How a checkpoint's FP8 weights carry their scales: the scale tensor's suffix (after
  the weight's name) and the block one scale covers ((rows, cols); "channel": one per
  output row; None: one per tensor)."""

  suffix: str
  block: tuple[int, int] | str | None

  def block_for(self, shape: Sequence[int]) -> tuple[int, int] | None:
    """The block of a weight of `shape` [..., rows, cols]."""
    return (1, int(shape[-1])) if self.block == "channel" else self.block


def fp8_layout(quantization: Mapping[str, Any]) -> Fp8Layout | None:
  """The FP8 layout a config.json's quantization_config describes (None: no FP8); a
  ValueError names a field this loader cannot honour."""
  method = quantization.get("quant_method")
  if method == "fp8":
    return Fp8Layout("_scale_inv", _fp8_block(quantization))
  if method == "compressed-tensors":
    return Fp8Layout("_scale", _compressed_block(quantization))
  return None


def _compressed_block(quantization: Mapping[str, Any]) -> tuple[int, int] | str | None:
  """The scale block of compressed-tensors' float-quantized FP8 weights (every group's
  weights 8-bit float, symmetric, one strategy); a ValueError names what is not."""
  where = QUANTIZATION_FIELD
  fmt = quantization.get("format")
  if fmt not in ("float-quantized", "naive-quantized"):
    raise ValueError(f"{where}.format: expected 'float-quantized' (FP8 weights; other "
                     f"compressed-tensors formats are not supported), got {fmt!r}")
  groups = quantization.get("config_groups") or {}
  if not groups:
    raise ValueError(f"{where}.config_groups: expected a group of FP8 weights, got none")
  blocks = set()
  for name, group in sorted(groups.items()):
    weights = (group or {}).get("weights") or {}
    field = f"{where}.config_groups.{name}.weights"
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
      raise ValueError(f"{field}: expected type 'float' of num_bits 8 (FP8), got "
                       f"{weights.get('type')!r} of {weights.get('num_bits')!r}")
    if weights.get("symmetric") is False:
      raise ValueError(f"{field}.symmetric: expected true, got false")
    strategy = weights.get("strategy")
    if strategy == "tensor":
      blocks.add(None)
    elif strategy == "channel":
      blocks.add("channel")
    elif strategy == "group" and isinstance(weights.get("group_size"), int):
      blocks.add((1, weights["group_size"]))
    elif strategy == "block" and _positive_pair(weights.get("block_structure")):
      blocks.add(tuple(weights["block_structure"]))
    else:
      raise ValueError(f"{field}.strategy: expected 'tensor', 'channel', 'group' (with a "
                       f"group_size) or 'block' (with a block_structure), got {strategy!r}")
  if len(blocks) > 1:
    raise ValueError(f"{where}.config_groups: expected one weight strategy for all groups, "
                     f"got {len(blocks)}")
  return blocks.pop()


def _positive_pair(block: Any) -> bool:
  return (isinstance(block, (list, tuple)) and len(block) == 2
          and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block))


def _fp8_block(quantization: Mapping[str, Any]) -> tuple[int, int] | None:
  """The [rows, cols] block one FP8 scale covers, from a `quant_method: fp8`
  quantization_config (None: one scale per tensor); a ValueError names a field this
  loader cannot honour."""
  where = QUANTIZATION_FIELD
  fmt = quantization.get("fmt", "e4m3")
  if fmt not in ("e4m3", "e5m2"):
    raise ValueError(f"{where}.fmt: expected 'e4m3' or 'e5m2', got {fmt!r}")
  scheme = quantization.get("activation_scheme", "dynamic")
  if scheme not in ("dynamic", "static"):  # activations run in bf16/float32 here either way
    raise ValueError(f"{where}.activation_scheme: expected 'dynamic' or 'static', got {scheme!r}")
  scale_fmt = quantization.get("scale_fmt") or "float"
  if scale_fmt not in ("float", "ue8m0"):
    raise ValueError(f"{where}.scale_fmt: expected 'float' or 'ue8m0', got {scale_fmt!r}")
  if quantization.get("expert_dtype", "fp8") != "fp8":
    raise ValueError(f"{where}.expert_dtype: expected 'fp8' (FP4 experts are not supported), "
                     f"got {quantization['expert_dtype']!r}")
  block = quantization.get("weight_block_size", (128, 128))
  if block is None:
    return None
  if not _positive_pair(block):
    raise ValueError(f"{where}.weight_block_size: expected two positive integers or null, "
                     f"got {block!r}")
  return int(block[0]), int(block[1])


def fp8_scale_shape(weight: Sequence[int], block: tuple[int, int] | None) -> tuple[int, ...]:
  """The grid of scales an FP8 `weight` shape [..., rows, cols] carries: one per `block`
  (the last block of a row or column may be partial), or () for one per tensor."""
  if block is None:
    return ()
  *lead, rows, cols = weight
  return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def check_fp8(weight: tuple[Sequence[int], str], scale: tuple[Sequence[int], str],
              block: tuple[int, int] | None) -> tuple[int, ...]:
  """The shape an FP8 `weight` and its `scale` (each as (shape, numpy dtype name))
  dequantize to; a ValueError unless the weight is 8-bit float of two or more dims and the
  scale a float (or E8M0 exponent) grid of the block's shape. Headers alone suffice."""
  (w, w_dtype), (s, s_dtype) = (tuple(weight[0]), weight[1]), (tuple(scale[0]), scale[1])
  if w_dtype not in _FP8_WEIGHTS or len(w) < 2:
    raise ValueError(f"FP8: expected a float8_e4m3fn or float8_e5m2 weight of 2 or more "
                     f"dims beside its scale, got {w_dtype} {w}")
  want = fp8_scale_shape(w, block)
  if s_dtype not in _FP8_SCALES or (s != want and not (block is None and np.prod(s) == 1)):
    raise ValueError(f"FP8: expected a float scale of shape {want} for a weight {w} in "
                     f"blocks of {block or 'one tensor'}, got {s_dtype} {s}")
  return w


FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


def quantize_fp8(weight: np.ndarray, block: tuple[int, int], scale_fmt: str = "float"
                 ) -> tuple[np.ndarray, np.ndarray]:
  """A weight [..., rows, cols] -> (float8_e4m3fn codes, float32 weight_scale_inv [...,
  ceil(rows / b0), ceil(cols / b1)]): per block (the last ones partial) the scale that
  brings its largest magnitude to 448, as DeepSeek-V3's and transformers' FP8 weights;
  `scale_fmt` "ue8m0": that scale rounded up to a power of two (DeepSeek-V3.1's, which
  DeepGEMM's UE8M0 kernels take as they are), the largest code then within (224, 448]."""
  if scale_fmt not in ("float", "ue8m0"):
    raise ValueError(f"scale_fmt: expected 'float' or 'ue8m0', got {scale_fmt!r}")
  w = np.asarray(weight, np.float32)
  *lead, rows, cols = w.shape
  grid = fp8_scale_shape(w.shape, block)
  padded = np.zeros((*lead, grid[-2] * block[0], grid[-1] * block[1]), np.float32)
  padded[..., :rows, :cols] = w
  tiles = padded.reshape(*lead, grid[-2], block[0], grid[-1], block[1])
  amax = np.abs(tiles).max(axis=(-3, -1))
  scale_inv = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
  if scale_fmt == "ue8m0":  # frexp: m in [0.5, 1); 2^e is exact unless amax / 448 is
    mantissa, exponent = np.frexp(scale_inv)
    scale_inv = np.ldexp(np.float32(1), exponent - (mantissa == 0.5)).astype(np.float32)
  full = np.repeat(np.repeat(scale_inv, block[0], axis=-2), block[1], axis=-1)
  codes = np.clip(w / full[..., :rows, :cols], -FP8_MAX, FP8_MAX)
  return codes.astype(ml_dtypes.float8_e4m3fn), scale_inv


def dequantize_fp8(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None,
                   dtype=np.float32) -> np.ndarray:
  """An FP8 `weight` [..., rows, cols] times its `scale` (weight_scale_inv: per `block`, the
  grid's last block partial where a dim does not divide, or one per tensor) in `dtype`:
  DeepSeek's weight_dequant. E8M0 scales (stored as float8_e8m0fnu or uint8) are 2^(e-127)."""
  check_fp8((weight.shape, weight.dtype.name), (scale.shape, scale.dtype.name), block)
  factor = (np.ldexp(np.float32(1), scale.astype(np.int32) - 127) if scale.dtype == np.uint8
            else scale.astype(np.float32))
  values = weight.astype(np.float32)
  if block is None:
    return (values * factor.reshape(())).astype(dtype, copy=False)
  rows, cols = weight.shape[-2:]
  factor = np.repeat(np.repeat(factor, block[0], axis=-2)[..., :rows, :], block[1], axis=-1)
  values *= factor[..., :cols]
  return values.astype(dtype, copy=False)


class RawTensors:
  """Tensors of dtypes safetensors' numpy reader refuses (the FP8 codes), read straight from
  files safe_open has opened (and so validated): the JSON header gives each tensor's dtype,
  shape and byte range. One header parse per file."""

  def __init__(self):
    self._headers: dict[str, tuple[int, dict]] = {}

  def _header(self, file: str) -> tuple[int, dict]:
    if file not in self._headers:
      with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        self._headers[file] = (8 + size, json.loads(f.read(size)))
    return self._headers[file]

  def read(self, file: str, stored: str) -> np.ndarray:
    """Tensor `stored` of safetensors `file`, as its FP8 type."""
    start, header = self._header(file)
    entry = header[stored]
    dtype = FP8_TYPES[entry["dtype"]]
    begin, end = entry["data_offsets"]  # safe_open, which opened the file first, checked them
    data = np.fromfile(file, dtype=np.uint8, count=end - begin, offset=start + begin)
    return data.view(dtype).reshape(entry["shape"])
