"""Published EAGLE-1/2 heads (``DraftHead.from_eagle``): synthetic releases written with the key
names, shapes and fc order of EAGLE's released code (tests/head_fit.write_eagle_release) load for
the target they fit, compute what an independent re-implementation of EAGLE's head computes from
the raw weights, draft in every role with greedy equality, and are refused with the reason for
another target or another format. The deep chi-square cell is in tests/test_lossless_deep.py
(``chain_eagle_release``)."""

import json

import pytest
import torch

from cascade import generate
from cascade.cascades import VerticalCascade
from cascade.drafters import DraftHeadDrafter, NGramDrafter, SmallLMDrafter
from cascade.models import perturbed_copy, tiny_llama
from cascade.models.heads.eagle import EAGLE_LAYOUT, DraftHead, HeadCheckpointError, HeadLayout
from cascade.models.layers import decoder_parts
from cascade.trees.drafter import TreeDrafter
from cascade.trees import DynamicTreePolicy, StaticTreePolicy
from head_fit import fitted_head, write_eagle_release


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=48, hidden_size=32, num_layers=2, seed=7)


@pytest.fixture(scope="module")
def release(target, tmp_path_factory):
    head = fitted_head(target, motif=3, layout=EAGLE_LAYOUT)
    return write_eagle_release(head, target, tmp_path_factory.mktemp("eagle"))


def _rotate_half(x):
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([-b, a], -1)


def eagle_reference(state: dict, config: dict, target, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """EAGLE-1/2's head from its raw weights, written out here: fc over [embedding, feature], one
    decoder layer without an input norm (causal attention with RoPE at positions 0..n-1, GQA), the
    target's LM head. features [n, H] (f_0..f_{n-1}), tokens [n] (x_1..x_n) -> logits [n, V]."""
    n, hidden = features.shape
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    dim = hidden // heads
    emb = state["embed_tokens.weight"][tokens]
    x = torch.cat([emb, features], -1) @ state["fc.weight"].T + state["fc.bias"]  # [n, H]
    p = lambda name: state[f"layers.0.{name}"]  # noqa: E731
    q = (x @ p("self_attn.q_proj.weight").T).view(n, heads, dim).transpose(0, 1)  # [heads, n, d]
    k = (x @ p("self_attn.k_proj.weight").T).view(n, kv, dim).transpose(0, 1)
    v = (x @ p("self_attn.v_proj.weight").T).view(n, kv, dim).transpose(0, 1)
    cos, sin = decoder_parts(target).rotary(x[None], position_ids=torch.arange(n)[None])  # [1, n, d]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = q @ k.transpose(1, 2) / dim ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    attn = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(n, hidden) @ p("self_attn.o_proj.weight").T
    h = x + attn
    h32 = h.float()  # Llama's RMSNorm normalises in float32 whatever the input dtype
    normed = p("post_attention_layernorm.weight") * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])).to(h.dtype)
    mlp = (torch.nn.functional.silu(normed @ p("mlp.gate_proj.weight").T) * (normed @ p("mlp.up_proj.weight").T)) \
        @ p("mlp.down_proj.weight").T
    return (h + mlp) @ decoder_parts(target).head.weight.T  # no final norm: the layer's output is the feature


def test_a_release_computes_what_eagles_head_computes(target, release):
    head = DraftHead.from_eagle(release, target)
    assert head.layout == EAGLE_LAYOUT
    state = torch.load(release / "pytorch_model.bin", weights_only=True)
    config = json.loads((release / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.vocab_size, (9,), generator=gen)
    features = torch.randn(9, 32, generator=gen, dtype=torch.float64) * 2
    with torch.no_grad():
        ours = head.readout(target)(head.double()(target, features, tokens, torch.arange(9)))
    want = eagle_reference({k: v.double() for k, v in state.items()}, config, target, features, tokens)
    torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-9)


def test_safetensors_releases_and_weight_files_load(target, tmp_path):
    head = fitted_head(target, motif=3, layout=EAGLE_LAYOUT)
    folder = write_eagle_release(head, target, tmp_path / "st", safetensors=True)
    for path in (folder, folder / "model.safetensors"):
        loaded = DraftHead.open(path, target)
        torch.testing.assert_close(loaded.fc.weight, head.fc.weight.float())


ROLES = {
    "chain": lambda path, close: DraftHeadDrafter(str(path), k=4),
    "static_tree": lambda path, close: TreeDrafter([DraftHeadDrafter(str(path))], StaticTreePolicy((2, 2, 1))),
    "cascade_top": lambda path, close: VerticalCascade([DraftHeadDrafter(str(path), k=5), NGramDrafter(k=2)]),
    "dytc": lambda path, close: TreeDrafter([DraftHeadDrafter(str(path)), SmallLMDrafter(close), NGramDrafter(k=1)],
                                            DynamicTreePolicy(t_min=0.05, max_nodes=16, max_depth=5, prior_drafter_cost=0.01,
                                                              prior_verify_slope=0.005, measure_costs=False)),
}


@pytest.mark.parametrize("role", list(ROLES))
def test_a_release_drafts_in_every_role_with_greedy_equality(role, target, release):
    drafter = ROLES[role](release, perturbed_copy(target, 0.3, seed=2))
    accepted = 0
    for prompt in ([1, 5, 9, 1, 5, 9, 1, 5], [3, 3, 7, 2, 3, 3, 7]):
        ar = generate(target, prompt, max_new_tokens=24)
        sp = generate(target, prompt, drafter=drafter, max_new_tokens=24)
        assert sp.tokens == ar.tokens, role
        accepted += sum(s.accepted for s in sp.steps)
    assert accepted > 0, role


def test_a_release_for_another_target_is_refused(target, release, tmp_path):
    wider = tiny_llama(vocab_size=48, hidden_size=48, num_layers=2, seed=7)
    with pytest.raises(HeadCheckpointError, match="another target.*hidden_size 32 \\(target 48\\)"):
        DraftHead.from_eagle(release, wider)
    other_vocab = tiny_llama(vocab_size=64, hidden_size=32, num_layers=2, seed=7)
    with pytest.raises(HeadCheckpointError, match="vocab_size 48 \\(target 64\\)"):
        DraftHead.from_eagle(release, other_vocab)
    # without a config.json the weights' shapes still tell
    state = torch.load(release / "pytorch_model.bin", weights_only=True)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(HeadCheckpointError, match="fc.weight \\(32, 64\\)"):
        DraftHead.from_eagle(tmp_path / "pytorch_model.bin", wider)
    # generate surfaces the refusal too
    with pytest.raises(HeadCheckpointError):
        generate(wider, [1, 2, 3], drafter=DraftHeadDrafter(str(release)), max_new_tokens=2)


def test_other_formats_are_refused_with_the_reason(target, release, tmp_path):
    state = torch.load(release / "pytorch_model.bin", weights_only=True)
    eagle3 = {"fc.weight": torch.zeros(32, 96), "midlayer.hidden_norm.weight": torch.ones(32), "d2t": torch.zeros(8, dtype=torch.long)}
    torch.save(eagle3, tmp_path / "e3.bin")
    with pytest.raises(HeadCheckpointError, match="EAGLE-3"):
        DraftHead.from_eagle(tmp_path / "e3.bin", target)
    two = dict(state, **{k.replace("layers.0.", "layers.1."): v for k, v in state.items() if k.startswith("layers.0.")})
    torch.save(two, tmp_path / "two.bin")
    with pytest.raises(HeadCheckpointError, match="decoder layers"):
        DraftHead.from_eagle(tmp_path / "two.bin", target)
    with pytest.raises(FileNotFoundError):
        DraftHead.from_eagle(tmp_path / "missing", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither"):
        DraftHead.from_eagle(tmp_path / "empty", target)


def test_a_release_without_qkv_biases_loads_on_a_target_whose_layers_have_them(tmp_path):
    """EAGLE's Llama-style heads have no q/k/v biases; on a Qwen2 target (biased projections) they
    load with zero biases, the same function."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cascade.models import CausalLM

    config = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    qwen = CausalLM(Qwen2ForCausalLM(config).double().eval(), None, "tiny-qwen2")
    head = DraftHead.from_target(qwen, layout=EAGLE_LAYOUT)
    folder = write_eagle_release(head, qwen, tmp_path / "q")
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save({k: v for k, v in state.items() if not k.endswith("_proj.bias")}, folder / "pytorch_model.bin")
    loaded = DraftHead.from_eagle(folder, qwen)
    assert all(float(b.detach().abs().max()) == 0 for n, b in loaded.layer.named_parameters() if n.endswith("_proj.bias"))
    ar = generate(qwen, [1, 2, 3, 4], max_new_tokens=12)
    assert generate(qwen, [1, 2, 3, 4], drafter=DraftHeadDrafter(loaded, k=3), max_new_tokens=12).tokens == ar.tokens


def test_layouts_round_trip_through_cascade_checkpoints(target, tmp_path):
    for layout in (HeadLayout(), HeadLayout("normed"), EAGLE_LAYOUT):
        head = DraftHead.from_target(target, seed=3, layout=layout)
        head.save(tmp_path / "h.pt")
        loaded = DraftHead.open(tmp_path / "h.pt", target)
        assert loaded.layout == layout
        assert loaded.state_dict().keys() == head.state_dict().keys()
