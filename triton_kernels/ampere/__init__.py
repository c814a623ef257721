"""A Gluon sparse prefill kernel for NVIDIA GPUs without wgmma (sm_80/86/89/120): mma.sync with hand-chosen layouts."""
