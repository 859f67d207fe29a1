"""How a model's forward runs: the ``Backend`` value (``backend``) chosen once at load, and what
it applies: cascade's native C++ kernels (``native``, source in ``csrc/``, built on first use
under ``build_lock``'s lock), the lean forward over them (``lean``), the direct forward every
other model runs (``direct``), quantized weights (``quantize``), FBGEMM / oneDNN CPU kernels
(``cpu_kernels``, ``exact_fp16``) and a GGUF file's own blocks (``gguf_weights``)."""
