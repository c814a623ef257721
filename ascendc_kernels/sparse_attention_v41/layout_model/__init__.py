"""A numpy model of the kernel's data movement on an Ascend 950 AI core, driven by the kernel's own headers.

``headers`` reads the constants and layouts of ``op_kernel/``; ``memory`` models the memories, the fractal formats
(ND, Nz, Zn) and the data paths (MTE2 copies, ND2NZ, vector copies, LoadData with transpose, Mmad, FixPipe);
``dequant`` the row decoders; ``replay`` one key block end to end against ``anymla.kvcache`` and float64 products;
``b8ab794`` the parameters of the kernel before issue 15's fixes. A model, not the hardware: it checks that the
parameters the kernel passes produce the layouts the documentation asks for, not that the documentation is right.
"""
