"""Warp-specialized kernels for Hopper GPUs (sm_90), written in Gluon: dense decoding and sparse prefill."""
