"""SGLang on machines without SGLang's CPU kernels: the `sgl_kernel` import shim (`shim/`),
the launcher (`python -m aerie_sglang.cpu.launch`) and plain-torch CPU ops (`ops`, optional).
Importing this package does nothing; SGLang's own environment is the one that runs it."""
