"""Published EAGLE-3 heads (``cascade.models.heads.eagle3``): synthetic releases written with the key
names, shapes and vocabulary maps of EAGLE-3's released code (tests/head_fit.eagle3_release)
load for the target they fit, compute what an independent re-implementation of EAGLE-3's head
computes from the raw weights, read the target's three layers through the decode loop, draft in
every role with greedy equality, and are refused with the reason for another target or broken
maps. The deep chi-square cell is in tests/test_lossless_deep.py (``chain_eagle3_release``)."""

import json

import pytest
import torch

from cascade import generate
from cascade.drafters import DraftHeadDrafter
from cascade.models import perturbed_copy, tiny_llama
from cascade.models.heads.eagle import DraftHead, HeadCheckpointError
from cascade.models.heads.eagle3 import FORMAT, Eagle3Head, open_head
from cascade.models.layers import decoder_parts
from head_fit import eagle3_config, eagle3_release, write_eagle3
from test_eagle_heads import ROLES, _rotate_half  # the same roles and RoPE helper as EAGLE-1/2 releases


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=48, hidden_size=32, num_layers=7, seed=7)


@pytest.fixture(scope="module")
def release(target):
    return eagle3_release(target)


def _rms(x, w, eps):
    x32 = x.float()  # Llama's RMSNorm normalises in float32 whatever the input dtype
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eagle3_reference(state: dict, config: dict, target, g: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's head from its raw weights, written out here: s = fc(g); attention over
    [input_layernorm(e(x)), hidden_norm(s)] (causal, RoPE at 0..n-1, GQA), residual s; MLP; final
    norm; lm_head over the draft vocabulary, draft id d at target id d + d2t[d]. g [n, 3H]
    (g_0..g_{n-1}), tokens [n] (x_1..x_n) -> logits [n, V] (-inf outside the draft vocabulary)."""
    n = g.shape[0]
    hidden, heads, kv, eps = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["rms_norm_eps"]
    dim = hidden // heads
    m = lambda name: state[f"midlayer.{name}"]  # noqa: E731
    s = g @ state["fc.weight"].T  # [n, H]
    e = state["embed_tokens.weight"][tokens]
    x = torch.cat([_rms(e, m("input_layernorm.weight"), eps), _rms(s, m("hidden_norm.weight"), eps)], -1)  # [n, 2H]
    q = (x @ m("self_attn.q_proj.weight").T).view(n, heads, dim).transpose(0, 1)
    k = (x @ m("self_attn.k_proj.weight").T).view(n, kv, dim).transpose(0, 1)
    v = (x @ m("self_attn.v_proj.weight").T).view(n, kv, dim).transpose(0, 1)
    # RoPE with the release's rope_theta, computed by the target's rotary (transformers computes the
    # angles in float32 whatever the dtype; the loader checks the two bases are equal)
    assert config["rope_theta"] == decoder_parts(target).config.rope_parameters["rope_theta"]
    cos, sin = decoder_parts(target).rotary(x[None], position_ids=torch.arange(n)[None])  # [1, n, d]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = (q @ k.transpose(1, 2) / dim ** 0.5).masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    h = s + (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(n, hidden) @ m("self_attn.o_proj.weight").T
    y = _rms(h, m("post_attention_layernorm.weight"), eps)
    h = h + (torch.nn.functional.silu(y @ m("mlp.gate_proj.weight").T) * (y @ m("mlp.up_proj.weight").T)) @ m("mlp.down_proj.weight").T
    rows = _rms(h, state["norm.weight"], eps) @ state["lm_head.weight"].T  # [n, Vd]
    out = torch.full((n, config["vocab_size"]), float("-inf"), dtype=rows.dtype)
    out[:, torch.arange(rows.shape[1]) + state["d2t"]] = rows
    return out


def test_the_loop_hands_over_the_three_layers_transformers_computes(target):
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    _, g = target.forward(ids, target.new_cache(), return_hidden=(2, 3, 4))
    with torch.no_grad():
        hs = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(g, torch.cat([hs[2][0], hs[3][0], hs[4][0]], -1), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="return_hidden"):
        target.forward(ids, target.new_cache(), return_hidden=(2, 7))
    with pytest.raises(ValueError, match="return_hidden"):
        target.forward(ids, target.new_cache(), return_hidden=(-1, 2))  # the final feature only last
    # EAGLE-3's training capture: the three layers and the LM head's input (after the final norm) in one forward
    _, g4 = target.forward(ids, target.new_cache(), return_hidden=(2, 3, 4, -1))
    torch.testing.assert_close(g4, torch.cat([hs[2][0], hs[3][0], hs[4][0], hs[-1][0]], -1), rtol=0, atol=1e-12)


def test_a_release_computes_what_eagle3s_head_computes(target, release):
    head = open_head(release, target)
    assert isinstance(head, Eagle3Head) and head.hidden_layer == (2, 3, 4) and head.feature_size == 96
    state = {k: (v.double() if v.is_floating_point() else v) for k, v in torch.load(release / "pytorch_model.bin", weights_only=True).items()}
    config = json.loads((release / "config.json").read_text())
    ids = [2, 7, 1, 8, 2, 8, 1, 8, 2]
    _, g = target.forward(ids, target.new_cache(), return_hidden=head.hidden_layer)  # [9, 96]
    tokens = torch.tensor(ids[1:] + [4])
    with torch.no_grad():
        ours = head.double().readout(target)(head(target, g, tokens, torch.arange(9)))
    want = eagle3_reference(state, config, target, g, tokens)
    torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-9)
    assert torch.isinf(ours[:, [5, 11]]).all()  # outside the draft vocabulary: never proposed


def test_safetensors_releases_and_explicit_layers_load(target, release, tmp_path):
    state = torch.load(release / "pytorch_model.bin", weights_only=True)
    config = json.loads((release / "config.json").read_text())
    folder = write_eagle3(state, dict(config, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 5]}),
                          tmp_path / "st", safetensors=True)
    for path in (folder, folder / "model.safetensors"):
        head = open_head(path, target)
        assert isinstance(head, Eagle3Head) and head.hidden_layer == (1, 4, 5)  # the config beside the weights
    with pytest.raises(HeadCheckpointError, match="EAGLE-3"):
        DraftHead.from_eagle(release, target)  # the EAGLE-1/2 loader names the other format


@pytest.mark.parametrize("role", list(ROLES))
def test_a_release_drafts_in_every_role_with_greedy_equality(role, target, release):
    drafter = ROLES[role](release, perturbed_copy(target, 0.3, seed=2))
    accepted = 0
    for prompt in ([1, 5, 9, 1, 5, 9, 1, 5], [3, 3, 7, 2, 3, 3, 7], [6]):
        ar = generate(target, prompt, max_new_tokens=24)
        sp = generate(target, prompt, drafter=drafter, max_new_tokens=24)
        assert sp.tokens == ar.tokens, role
        accepted += sum(s.accepted for s in sp.steps)
    assert accepted > 0, role


def test_a_release_for_another_target_or_with_broken_maps_is_refused(target, release, tmp_path):
    state = torch.load(release / "pytorch_model.bin", weights_only=True)
    config = json.loads((release / "config.json").read_text())
    wider = tiny_llama(vocab_size=48, hidden_size=48, num_layers=7, seed=7)
    with pytest.raises(HeadCheckpointError, match="hidden_size 32 \\(target 48\\)"):
        open_head(release, wider)
    other_vocab = tiny_llama(vocab_size=64, hidden_size=32, num_layers=7, seed=7)
    with pytest.raises(HeadCheckpointError, match="vocab_size 48 \\(target 64\\)"):
        open_head(release, other_vocab)
    shallow = tiny_llama(vocab_size=48, hidden_size=32, num_layers=3, seed=7)
    with pytest.raises(HeadCheckpointError, match="captured layers"):
        open_head(release, shallow)
    clash = dict(state, d2t=torch.zeros_like(state["d2t"]))  # two draft ids onto one target id
    clash["d2t"][1] = -1
    with pytest.raises(HeadCheckpointError, match="d2t maps"):
        open_head(write_eagle3(clash, config, tmp_path / "clash"), target)
    no_map = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    with pytest.raises(HeadCheckpointError, match="no d2t"):
        open_head(write_eagle3(no_map, config, tmp_path / "nomap"), target)
    stale = dict(state, t2d=~state["t2d"])
    with pytest.raises(HeadCheckpointError, match="t2d"):
        open_head(write_eagle3(stale, config, tmp_path / "t2d"), target)
    partial = {k: v for k, v in state.items() if k != "norm.weight"}
    with pytest.raises(HeadCheckpointError, match="lacks"):
        open_head(write_eagle3(partial, config, tmp_path / "partial"), target)
    # generate surfaces the refusal too
    with pytest.raises(HeadCheckpointError):
        generate(wider, [1, 2, 3], drafter=DraftHeadDrafter(str(release)), max_new_tokens=2)


def test_eagle3_config_matches_the_head_it_describes(target, release):
    config = json.loads((release / "config.json").read_text())
    assert config == eagle3_config(target, target.vocab_size - 2)
    head = open_head(release, target)
    assert head.lm_head.weight.shape == (target.vocab_size - 2, decoder_parts(target).config.hidden_size)


# ---- training EAGLE-3 heads (python -m cascade.train_head train.recipe=eagle3) ------------------


def _chunk3(target, ids, layers):
    from cascade.head_training import Chunk, target_features

    feats = target_features(target, ids, layers)  # [T, 4H]
    hidden = feats.shape[-1] // (len(layers) + 1)
    return Chunk(torch.tensor(ids), feats[:, :-hidden], feats[:, -hidden:])


def test_training_tuples_of_eagle3_align_with_transformers_own_model(target):
    """What an EAGLE-3 head trains on: g_u (the three layers at u, as transformers computes them),
    x_{u+1}, and the teacher: the target's law of x_{u+2} (its logits at u + 1)."""
    ids = torch.randint(0, target.vocab_size, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    layers = (2, 3, 4)
    chunk = _chunk3(target, ids, layers)
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hs = out.hidden_states
    torch.testing.assert_close(chunk.features, torch.cat([hs[i][0] for i in layers], -1), rtol=0, atol=1e-12)
    teacher = torch.softmax(chunk.teacher[1:] @ decoder_parts(target).head.weight.T, -1)  # chunk_loss's teacher
    torch.testing.assert_close(teacher, torch.softmax(out.logits[0], -1)[1:], rtol=0, atol=1e-10)


def test_unrolled_eagle3_step_equals_drafting(target):
    """Row u of unrolled step s is what drafting s tokens deep from root u - s + 1 computes: step 1
    reads the three layers through fc, deeper steps the head's own states (no fc)."""
    from cascade.head_training import unroll

    head = Eagle3Head.from_target(target, layers=(2, 3, 4), seed=1).to(target.dtype)
    ids = torch.randint(0, target.vocab_size, (16,), generator=torch.Generator().manual_seed(5)).tolist()
    chunk = _chunk3(target, ids, (2, 3, 4))
    with torch.no_grad():
        outs = unroll(head, target, chunk, 3)
        for u, s in ((7, 3), (9, 2), (12, 3)):
            root = u - s + 1
            cache = head.new_cache()
            f = head(target, chunk.features[: root + 1], chunk.tokens[1 : root + 2], torch.arange(root + 1), cache)[-1]
            for pos in range(root + 1, u + 1):
                f = head(target, f[None], chunk.tokens[pos + 1 : pos + 2], torch.tensor([pos]), cache)[-1]
            torch.testing.assert_close(outs[s - 1][u], f, atol=1e-9, rtol=1e-9)


def test_an_eagle3_head_fits_its_training_text(target):
    """The training path can fit: a fresh head trained on a few chunks with chunk_loss reaches
    top-1 agreement >= 0.9 with the target at depth 1 on them (untrained: far below)."""
    from cascade.head_training import agreement, chunk_loss

    gen = torch.Generator().manual_seed(6)
    chunks = [_chunk3(target, torch.randint(0, target.vocab_size, (24,), generator=gen).tolist(), (2, 3, 4)) for _ in range(3)]
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, layers=(2, 3, 4), seed=0).to(target.dtype)
    rows = decoder_parts(target).head.weight.detach()
    before = agreement(head, target, chunks, rows, head.vocab, depths=1)[0]
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for step in range(150):
        opt.zero_grad()
        loss = sum(chunk_loss(head, target, c, rows, 1, 1.0)[0] for c in chunks)
        loss.backward()
        opt.step()
    after = agreement(head, target, chunks, rows, head.vocab, depths=1)[0]
    assert before < 0.5 and after >= 0.9, (before, after)


def test_train_an_eagle3_head_then_draft_with_it(tmp_path):
    """``train.recipe=eagle3`` captures the three layers and the final feature, trains, and
    writes an EAGLE-3 release directory that open_head reads back weight for weight, that drafts
    with greedy equality, and that another target refuses."""
    from hydra import compose, initialize_config_dir

    from cascade.models import load_model
    from cascade.train_head import train
    from test_draft_head import CONF

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train_head", overrides=["debug=tiny", "progress=false", f"output_dir={tmp_path / 'out'}",
                                               "train.recipe=eagle3", f"train.save_to={tmp_path / 'e3'}",
                                               "train.max_tokens=1200", f"train.features_dir={tmp_path / 'features'}"])
    summary = train(cfg)
    m = summary["metrics"]
    assert m["recipe"] == "eagle3" and m["layers"] == [2, 2, 1] and len(m["agreement"]) == 4  # tiny: 4 layers
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "features").glob("*/manifest.json")]
    assert [x["layers"] for x in manifests] == [[2, 2, 1]]
    chunk = torch.load(next((tmp_path / "features").rglob("chunk_00000.pt")), weights_only=True)
    assert chunk["features"].shape[-1] == 3 * chunk["final"].shape[-1]
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["cascade"]["format"] == FORMAT and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]
    target = load_model(cfg.models.target, cfg.models.backend)
    head = open_head(tmp_path / "e3", target)
    assert isinstance(head, Eagle3Head) and head.metrics["agreement"] == m["agreement"]
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "e3" / "model.safetensors"))
    for k, v in head.release_state().items():
        assert torch.equal(v, written[k]), k
    drafter = DraftHeadDrafter(str(tmp_path / "e3"), k=3)
    prompt = target.encode("def f(x):")
    assert generate(target, prompt, drafter=drafter, max_new_tokens=12).tokens == generate(target, prompt, max_new_tokens=12).tokens
    other = load_model("tiny:1", cfg.models.backend)
    with pytest.raises(HeadCheckpointError, match="trained for 'tiny:0'"):
        open_head(tmp_path / "e3", other)
