"""Inference workers: the sampler, in-place weight application and the preemptible worker loop."""
