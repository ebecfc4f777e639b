"""Training: sharded state, the jitted step, SFT data and evaluation, the SFT trainer.

Importable without the parameter server: nothing here touches gRPC.
"""
