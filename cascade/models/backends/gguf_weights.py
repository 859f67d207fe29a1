"""The ``gguf`` backend: a model's weights as its GGUF file holds them.

Every linear layer keeps the file's own blocks (Q4_K, Q6_K, Q5_0, Q8_0, Q4_1; rows in the file's
order, ``[N, K / QK * bytes]`` uint8) and multiplies with ``csrc/gguf.cpp``: each weight
dequantized exactly as the ``gguf`` package's reference ``dequantize`` does, fp32 activations,
fp32 sums, row-invariant (a k-token verification is bitwise k single steps). The token embedding
keeps its blocks too (rows dequantized on lookup); norms and biases are the file's F32 tensors.
So the model is the file's real-valued model, whatever copy transformers built the modules from;
a parameter the file does not provide is an error, never a silent 16-bit leftover.

An F32 / F16 tensor (a file that does not quantize some layer) keeps an exact fp32 ``nn.Linear``;
a block type without a kernel is an error naming it (the extension's own list: ``csrc/gguf.cpp``).

The ``gguf_q8`` backend is the same with llama.cpp's kind of arithmetic for the k-quants: Q4_K /
Q6_K layers multiply activations quantized per 256 to int8 with integer sums
(``csrc/gguf_q8.cpp``; row-invariant, bitwise an integer reference); the other block types stay
exact.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from torch import nn

from cascade.models.backends.native import NativeLinear, native_kernels, unavailable_reason

log = logging.getLogger(__name__)

# a decoder layer's tensors in the file -> the module path under model.layers[i]
_LAYER_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
_LAYER_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def _ext():
    ext = native_kernels()
    if ext is None:
        raise RuntimeError(f"backend 'gguf': cascade's native kernels are unavailable ({unavailable_reason()})")
    return ext


class FileTensor:
    """One tensor of a GGUF file: its ggml type name, logical shape [rows, K] (rows = output
    features) and bytes ([rows, row bytes] uint8, copied out of the file's memory map)."""

    def __init__(self, tensor) -> None:
        self.type_name = tensor.tensor_type.name
        self.qtype = int(tensor.tensor_type)
        dims = [int(d) for d in tensor.shape]  # ggml order: K first
        self.k, self.rows = dims[0], int(np.prod(dims[1:])) if len(dims) > 1 else 1
        self.data = torch.from_numpy(np.array(tensor.data, copy=True)).view(torch.uint8).reshape(self.rows, -1)

    def dense(self) -> torch.Tensor:  # [rows, K] fp32, exactly as the reference dequantizes
        if self.type_name == "F32":
            return self.data.view(torch.float32).reshape(self.rows, self.k).clone()
        if self.type_name == "F16":
            return self.data.view(torch.float16).reshape(self.rows, self.k).float()
        return _ext().dequantize_gguf(self.check_kernel(), self.qtype, self.k)

    def check_kernel(self) -> torch.Tensor:
        """The blocks, when the extension has a kernel for their type (it alone says which)."""
        try:
            _ext().gguf_block_weights(self.qtype)
        except RuntimeError as exc:
            raise ValueError(f"GGUF tensor of type {self.type_name}: {exc} (F32 and F16 tensors stay exact fp32)") from exc
        return self.data

    def rows_permuted(self, heads: int) -> "FileTensor":
        """llama.cpp's converter interleaves the rotary halves of q / k rows for Llama models
        (``permute``); this undoes it by reordering whole rows (their bytes are unchanged)."""
        head_dim = self.rows // heads
        order = torch.arange(self.rows).reshape(heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)
        self.data = self.data[order].contiguous()
        return self


class NativeGGUFLinear(NativeLinear):
    """A linear layer on a GGUF file's blocks (``csrc/gguf.cpp``): exact reference weights, fp32
    arithmetic, row-invariant."""

    KIND, PANEL_TENSORS = "gguf", {"packed": "blocks"}

    def __init__(self, weight: FileTensor, bias: torch.Tensor | None) -> None:  # noqa: super().__init__ takes an nn.Linear
        nn.Module.__init__(self)
        _ext()
        self.in_features, self.out_features = weight.k, weight.rows
        self.blocks, self.qtype = weight.check_kernel(), weight.qtype
        self.bias = None if bias is None else bias.float().contiguous()

    def op_fields(self) -> dict:
        return {**super().op_fields(), "group": self.qtype}  # the LinearOp's group field holds the block type

    def join_key(self) -> tuple:
        return (*super().join_key(), self.qtype)

    def _matmul(self, x2d):
        return _ext().linear_gguf(x2d, self.blocks, self.qtype, self.out_features, self.bias)

    def dense_weight(self) -> torch.Tensor:
        return _ext().dequantize_gguf(self.blocks, self.qtype, self.in_features)

    def extra_repr(self) -> str:
        name = GGMLQuantizationType(self.qtype).name
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={name}"


class NativeGGUFQ8Linear(NativeGGUFLinear):
    """A Q4_K / Q6_K layer with int8 activations (``csrc/gguf_q8.cpp``): each row's blocks of 256
    quantized to int8, integer sums, a fixed fp32 epilogue per block: llama.cpp's kind of
    arithmetic, row-invariant, bitwise an integer reference. Not the file's real-valued model:
    the activations are rounded."""

    KIND = "gguf_q8"

    def _matmul(self, x2d):
        return _ext().linear_gguf_q8(x2d, self.blocks, self.qtype, self.out_features, self.bias)


class GGUFEmbedding(nn.Module):
    """The token embedding on the file's blocks: the looked-up rows dequantized exactly (fp32)."""

    def __init__(self, weight: FileTensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.rows, weight.k
        self.file_tensor = weight
        self.dense_rows = weight.data.view(torch.float32).reshape(weight.rows, weight.k) if weight.type_name == "F32" else None
        if self.dense_rows is None:
            weight.check_kernel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., E] fp32
        flat = ids.reshape(-1).long().contiguous()
        if self.dense_rows is not None:
            rows = self.dense_rows[flat]
        else:
            rows = _ext().dequantize_gguf(self.file_tensor.data, self.file_tensor.qtype, self.embedding_dim, rows=flat)
        return rows.reshape(*ids.shape, self.embedding_dim)


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, module)


def _f32(tensors: dict[str, FileTensor], name: str) -> torch.Tensor:
    t = tensors[name]
    if t.type_name != "F32":
        raise ValueError(f"{name} is {t.type_name}; norms and biases are expected F32")
    return t.dense().reshape(-1)


def _linear(tensors: dict[str, FileTensor], prefix: str, heads: int | None, int8_activations: bool = False) -> nn.Module:
    weight = tensors[f"{prefix}.weight"]
    if heads is not None:
        weight.rows_permuted(heads)
    bias = _f32(tensors, f"{prefix}.bias") if f"{prefix}.bias" in tensors else None
    if weight.type_name in ("F32", "F16"):  # an unquantized layer: the exact fp32 linear
        linear = nn.Linear(weight.k, weight.rows, bias=bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight.dense())
            if bias is not None:
                linear.bias.copy_(bias)
        return linear
    if int8_activations and _ext().gguf_q8_supported(weight.qtype):
        return NativeGGUFQ8Linear(weight, bias)
    return NativeGGUFLinear(weight, bias)


class _FileWeights:
    """A GGUF file's tensors as they are handed to a model: which were used (per ggml type) and
    which of the model's parameters got the file's values."""

    def __init__(self, path: Path, int8_activations: bool) -> None:
        reader = GGUFReader(str(path))  # the ecosystem's reader
        self.path, self.int8_activations = path, int8_activations
        self.tensors = {t.name: FileTensor(t) for t in reader.tensors}
        field = reader.fields.get("general.architecture")
        self.arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
        self.used: dict[str, int] = {}
        self.written: set[int] = set()  # ids of the parameters given the file's values

    def take(self, name: str) -> FileTensor:
        if name not in self.tensors:
            raise ValueError(f"{self.path}: no tensor {name!r} (architecture {self.arch}); this model is not the file's")
        self.used[self.tensors[name].type_name] = self.used.get(self.tensors[name].type_name, 0) + 1
        return self.tensors[name]

    def linear(self, prefix: str, heads: int | None, like: nn.Module | None = None) -> nn.Module:
        self.take(f"{prefix}.weight")
        new = _linear(self.tensors, prefix, heads, self.int8_activations)
        if like is not None and ((new.in_features, new.out_features) != (like.in_features, like.out_features)
                                 or (new.bias is None) != (like.bias is None)):
            raise ValueError(f"{prefix}: the file's layer is {new.in_features} -> {new.out_features} "
                             f"(bias {new.bias is not None}), the model's {like.in_features} -> {like.out_features}")
        self.written.update(id(p) for p in new.parameters())
        return new

    def norm(self, module: nn.Module, name: str) -> None:
        self.take(name)
        with torch.no_grad():
            module.weight.copy_(_f32(self.tensors, name))
        self.written.add(id(module.weight))


def use_gguf_weights(model: nn.Module, path: Path, int8_activations: bool = False) -> dict[str, int]:
    """Replace every weight of a Llama / Qwen2-style fp32 ``model`` by the GGUF file's (in
    place): linears on the file's blocks, the embedding on its blocks, norms and biases its F32
    tensors. ``int8_activations`` (backend ``gguf_q8``): the Q4_K / Q6_K layers multiply int8
    activations (:class:`NativeGGUFQ8Linear`), the other block types stay exact. Returns the
    count of tensors per ggml type used. Raises when the file and the model do not match (a
    missing tensor, another layer count or shape)."""
    file = _FileWeights(path, int8_activations)
    config, base = model.config, model.model
    permute = file.arch == "llama"  # llama.cpp's converter permutes Llama's q / k rows (not Qwen2's)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads} if permute else {}
    for i, layer in enumerate(base.layers):
        for short, module_path in _LAYER_LINEARS.items():
            _set_module(layer, module_path, file.linear(f"blk.{i}.{short}", heads.get(short), layer.get_submodule(module_path)))
        for short, module_path in _LAYER_NORMS.items():
            file.norm(layer.get_submodule(module_path), f"blk.{i}.{short}.weight")
    file.norm(base.norm, "output_norm.weight")
    base.embed_tokens = GGUFEmbedding(file.take("token_embd.weight"))
    tied = "output.weight" not in file.tensors  # then the LM head is the embedding's blocks
    model.lm_head = file.linear("token_embd" if tied else "output", None)
    model.config.tie_word_embeddings = False
    if model.lm_head.out_features != config.vocab_size:
        raise ValueError(f"{path}: the LM head has {model.lm_head.out_features} rows, the model's vocabulary {config.vocab_size}")
    leftover = [n for n, p in model.named_parameters() if id(p) not in file.written]
    if leftover:
        raise ValueError(f"{path}: parameters the file did not replace: {leftover[:5]}")
    log.info("%s: weights from %s (%s)", getattr(model, "name_or_path", "model"), path.name,
             ", ".join(f"{n} {t}" for t, n in sorted(file.used.items())))
    return file.used
