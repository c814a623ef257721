"""``sparse_attention_v41``: DSA prefill and V4.1 decoding on Ascend 950 (FlashMLA's design, written from scratch).

``op_kernel/`` holds the device code (``.asc``) and the tiling POD shared with the host, ``host/`` the
torch.library binding, ``CMakeLists.txt`` the CANN build, ``emulation.py`` the CPU model of the kernel's
blocking order, ``README.md`` the design and what has and has not been verified.
"""
