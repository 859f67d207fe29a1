"""Tiny GGUF files written with the `gguf` package's writer, for the gguf backend's tests and
deep cells: a tiny Llama's weights quantized to the legacy formats (the package's own quantizers)
or replaced by random blocks of the k-quant formats (the package has no k-quant quantizer; the
reference ``dequantize`` defines the model either way)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from cascade.models import tiny_llama
from cascade.models.backends.backend import BACKENDS
from cascade.models.backends.gguf_weights import use_gguf_weights
from cascade.models.backends.lean import attach_lean

# the fp16 field(s) of each format's block: byte offsets
F16_FIELDS = {T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q6_K: (208,)}
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}


def random_blocks(qtype: T, rows: int, k: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """[rows, k / QK * bytes] uint8: random codes and scale bytes, the fp16 scales finite
    (normal(0, scale), so some negative, a few subnormal)."""
    qk, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, k // qk, nbytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        d = rng.normal(0.0, scale, size=(rows, k // qk)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = d.view(np.uint8).reshape(rows, k // qk, 2)
    return blocks.reshape(rows, -1)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's converter's q / k row order
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, lm, types: dict[str, T], seed: int = 0) -> Path:
    """Write ``lm`` (a tiny Llama) as a GGUF file: each linear (by its file name, ``attn_q`` ..
    ``ffn_down``, ``output``; ``token_embd``) in ``types``' format: the legacy formats quantize
    the model's weights, the k-quants are random blocks. Norms F32."""
    rng = np.random.default_rng(seed)
    config, base = lm.model.config, lm.model.model
    writer = gguf.GGUFWriter(str(path), "llama")

    def add(name: str, weight: torch.Tensor, qtype: T, heads: int | None = None) -> None:
        w = weight.detach().double().float().numpy()
        if heads is not None:
            w = _permute(w, heads)
        if qtype in (T.Q4_K, T.Q6_K):
            data = random_blocks(qtype, w.shape[0], w.shape[1], rng, scale=0.02)
        else:
            data = gguf.quants.quantize(w, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)

    for i, layer in enumerate(base.layers):
        for short, module in LINEARS.items():
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(short)
            add(f"blk.{i}.{short}.weight", layer.get_submodule(module).weight, types[short], heads)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight.detach().float().numpy())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight.detach().float().numpy())
    writer.add_tensor("output_norm.weight", base.norm.weight.detach().float().numpy())
    add("token_embd.weight", base.embed_tokens.weight, types["token_embd"])
    add("output.weight", lm.model.lm_head.weight, types["output"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LEGACY = {**{k: T.Q8_0 for k in ("attn_q", "attn_k", "attn_v", "attn_output")}, "ffn_gate": T.Q5_0, "ffn_up": T.Q5_0,
          "ffn_down": T.Q4_1, "token_embd": T.Q8_0, "output": T.Q4_1}
K_QUANTS = {**{k: T.Q4_K for k in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")}, "attn_v": T.Q6_K,
            "ffn_down": T.Q6_K, "token_embd": T.Q4_K, "output": T.Q6_K}


def gguf_copy(make, path: Path, types: dict[str, T], seed: int = 0, int8_activations: bool = False):
    """``make()`` (a tiny Llama) written as a GGUF file at ``path``, and a fresh fp32 ``make``-shaped
    model on the ``gguf`` backend holding the file's weights (``int8_activations``: ``gguf_q8``), as
    ``load_model(file, backend=...)`` places them. Returns (model, file)."""
    file = write_tiny_gguf(path, make(), types, seed)
    lm = make()
    lm.model.float()
    use_gguf_weights(lm.model, file, int8_activations=int8_activations)
    attach_lean(lm)
    lm.backend = BACKENDS["gguf_q8" if int8_activations else "gguf"]
    return lm, file


def tiny_gguf_target(path: Path, types: dict[str, T] = LEGACY, hidden_size: int = 64, seed: int = 0,
                     int8_activations: bool = False):
    """A tiny Llama (vocabulary 256, 4 layers) on the ``gguf`` backend (``int8_activations``:
    ``gguf_q8``), its weights the file written at ``path``, and the file."""
    def fresh():
        return tiny_llama(vocab_size=256, hidden_size=hidden_size, num_layers=4, seed=seed, dtype=torch.float32,
                          name=f"tiny-gguf:{seed}")

    return gguf_copy(fresh, path, types, seed, int8_activations)


def reference_model(lm, file: Path):
    """A float64 model shaped like ``lm`` holding the file's reference-dequantized weights (the
    ``gguf`` package's ``dequantize``; q / k rows put back in the model's order by inverting the
    writer's permutation): the independent reference of a GGUF target."""
    config = lm.model.config
    ref = tiny_llama(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                     num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, seed=0,
                     dtype=torch.float64)
    tensors = {t.name: t for t in gguf.GGUFReader(str(file)).tensors}

    def dense(name, heads=None):
        t = tensors[name]
        w = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(-1, int(t.shape[0]))
        if heads is not None:
            order = _permute(np.arange(w.shape[0])[:, None], heads)[:, 0]  # file row r holds model row order[r]
            out = np.empty_like(w)
            out[order] = w
            w = out
        return torch.from_numpy(w.astype(np.float64))

    with torch.no_grad():
        for i, layer in enumerate(ref.model.model.layers):
            for short, module in LINEARS.items():
                heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(short)
                layer.get_submodule(module).weight.copy_(dense(f"blk.{i}.{short}.weight", heads))
            layer.input_layernorm.weight.copy_(dense(f"blk.{i}.attn_norm.weight").reshape(-1))
            layer.post_attention_layernorm.weight.copy_(dense(f"blk.{i}.ffn_norm.weight").reshape(-1))
        ref.model.model.norm.weight.copy_(dense("output_norm.weight").reshape(-1))
        ref.model.model.embed_tokens.weight.copy_(dense("token_embd.weight"))
        ref.model.lm_head.weight.copy_(dense("output.weight"))
    return ref
