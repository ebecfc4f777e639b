"""Decoder-only language models in Flax NNX (the families of `hf.ARCHITECTURES`), their
caches, flat parameter views and HF checkpoints, and reward models (sequence classifiers)."""

from rlax_ps.models.config import ModelConfig
from rlax_ps.models.hf import (config_from_hf, config_to_hf, load_hf_checkpoint,
                                longest_sequence, model_config_from, save_hf_checkpoint)
from rlax_ps.models.kv_cache import KVCache
from rlax_ps.models.params import assign_params, flatten_params
from rlax_ps.models.reward_model import RewardModel, load_reward_model
from rlax_ps.models.transformer import Transformer

__all__ = ["ModelConfig", "KVCache", "Transformer", "assign_params", "flatten_params",
           "config_from_hf", "config_to_hf", "load_hf_checkpoint", "longest_sequence",
           "model_config_from", "save_hf_checkpoint", "RewardModel", "load_reward_model"]
