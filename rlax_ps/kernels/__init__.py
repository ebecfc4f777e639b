"""Shared-prompt attention: the packed [P + N*R] training kernel and N-sample decode.

Pallas TPU (Mosaic) and Pallas GPU (Triton) kernels with plain-XLA references and
fallbacks, dispatched per platform (see dispatch.py), plus GRPO group packing.
"""

from rlax_ps.kernels.dispatch import (shared_prefix_decode_attention,
                                     shared_prefix_extend_attention, shared_prompt_attention)
from rlax_ps.kernels.layout import SharedPromptLayout, make_layout
from rlax_ps.kernels.packing import (pack_group, pack_routes, packed_attention_fn,
                                     packed_response_logprobs, packed_response_topk,
                                     response_logprobs)
from rlax_ps.kernels.schedule import BlockSizes

__all__ = ["BlockSizes", "SharedPromptLayout", "make_layout", "pack_group", "pack_routes",
           "packed_attention_fn", "packed_response_logprobs", "packed_response_topk",
           "response_logprobs",
           "shared_prefix_decode_attention", "shared_prefix_extend_attention",
           "shared_prompt_attention"]
