"""rlax-ps: RL post-training of language models in JAX around a parameter server.

Importing the package is cheap and pulls in no JAX: subpackages load what they need.
"""

__version__ = "0.1.0"
