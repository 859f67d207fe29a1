"""The EAGLE-style draft head: features, greedy equality in every role, checkpoints, training."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from cascade import generate
from cascade.cascades import HorizontalCascade, VerticalCascade
from cascade.drafters import ConfidenceStop, DraftHeadDrafter, NGramDrafter, SmallLMDrafter, ThompsonStop
from cascade.head_training import Chunk, target_features, unroll, unroll_mask
from cascade.models import tiny_llama
from cascade.models.heads.eagle import DraftHead, HeadCheckpointError
from cascade.trees.drafter import TreeDrafter
from cascade.trees import DynamicTreePolicy, RerankedTreePolicy, StaticTreePolicy
from head_fit import fitted_head
from test_greedy_equality import _prompts

CONF = str((__import__("pathlib").Path(__file__).parents[1] / "conf").resolve())


@pytest.fixture(scope="module")
def head(tiny_target):
    return fitted_head(tiny_target)


class Recording(DraftHeadDrafter):
    """Keeps the features the decode loop handed over."""

    def features(self):
        return self._feats


@pytest.mark.parametrize("tree", [False, True])
def test_features_handed_by_the_loop_equal_the_training_capture(tree, tiny_target, head):
    drafter = Recording(head, k=4)
    maker = (lambda: TreeDrafter([drafter], StaticTreePolicy((2, 2, 1)))) if tree else (lambda: drafter)
    for prompt in _prompts(4, seed=5):
        gen = generate(tiny_target, prompt, drafter=maker(), max_new_tokens=25, stop_on_eos=False)
        seq = prompt + gen.tokens
        got = drafter.features()  # [len(seq) - 1, H]: every committed position but the last
        assert got.shape[0] == len(seq) - 1
        want = target_features(tiny_target, seq[:-1])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert sum(s.accepted for s in gen.steps) > 0


def _roles(head, close):
    return {
        "chain": lambda: DraftHeadDrafter(head, k=4),
        "chain_k1": lambda: DraftHeadDrafter(head, k=1),
        "chain_confidence_stop": lambda: DraftHeadDrafter(head, k=6, stop=ConfidenceStop(0.4)),
        "chain_thompson_stop": lambda: DraftHeadDrafter(head, k=6, stop=ThompsonStop(0.3)),
        "static_tree": lambda: TreeDrafter([DraftHeadDrafter(head)], StaticTreePolicy((3, 2, 1, 1))),
        "reranked_tree": lambda: TreeDrafter([DraftHeadDrafter(head)], RerankedTreePolicy(top_k=3, depth=4, max_nodes=10)),
        "dynamic_tree": lambda: TreeDrafter([DraftHeadDrafter(head), SmallLMDrafter(close), NGramDrafter(k=1)],
                                            DynamicTreePolicy(max_nodes=16, max_depth=5, measure_costs=False)),
        "vertical_top": lambda: VerticalCascade([DraftHeadDrafter(head, k=5), NGramDrafter(k=2, max_ngram=2)]),
        "horizontal": lambda: HorizontalCascade([(DraftHeadDrafter(head, k=3), 3), (NGramDrafter(k=2), 2)]),
    }


@pytest.mark.parametrize("role", list(_roles(None, None)))
def test_greedy_equals_autoregressive(role, tiny_target, tiny_close_drafter, head):
    drafter = _roles(head, tiny_close_drafter)[role]()  # reused across generations: reset() must clear it
    accepted = 0
    for i, prompt in enumerate(_prompts(8, seed=11)):
        for max_new in (1, 2, 9, 30) if i < 2 else (24,):
            ar = generate(tiny_target, prompt, max_new_tokens=max_new, stop_on_eos=False)
            sp = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=max_new, stop_on_eos=False)
            assert sp.tokens == ar.tokens, (role, prompt, max_new)
            accepted += sum(s.accepted for s in sp.steps)
    assert accepted > 0, "the test must exercise accepted drafts"


def test_a_fitted_head_drafts_deep(tiny_target, head):
    """The fixture head is accepted beyond the first token (what the role tests rely on)."""
    sp = generate(tiny_target, _prompts(1, seed=2)[0], drafter=DraftHeadDrafter(head, k=4), max_new_tokens=60,
                  stop_on_eos=False)
    assert max(s.accepted for s in sp.steps) >= 2


def test_head_cannot_be_a_lower_cascade_level(tiny_target, tiny_close_drafter, head):
    with pytest.raises(ValueError, match="hidden states"):
        VerticalCascade([SmallLMDrafter(tiny_close_drafter), DraftHeadDrafter(head)])


def test_checkpoint_round_trip_and_refusals(tmp_path, tiny_target, head):
    path = head.save(tmp_path / "head.pt", metrics={"note": 1})
    loaded = DraftHead.load(path, tiny_target)
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k].float(), v.float()), k
    assert loaded.metrics == {"note": 1}
    deeper = tiny_llama(vocab_size=32, seed=0, num_layers=3)
    with pytest.raises(HeadCheckpointError, match="num_layers"):
        DraftHead.load(path, deeper)
    wider = tiny_llama(vocab_size=32, seed=0, hidden_size=48)
    with pytest.raises(HeadCheckpointError, match="hidden_size"):
        DraftHead.load(path, wider)
    renamed = tiny_llama(vocab_size=32, seed=0, name="another-target")
    with pytest.raises(HeadCheckpointError, match="target"):
        DraftHeadDrafter(str(path)).check_compatible(renamed)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(Exception):
        DraftHead.load(tmp_path / "junk.pt", tiny_target)
    with pytest.raises(FileNotFoundError, match="train_head"):
        DraftHead.load(tmp_path / "missing.pt", tiny_target)


def test_pruned_vocabulary_never_proposes_other_ids(tiny_target):
    vocab = torch.arange(0, 32, 2)
    head = fitted_head(tiny_target, steps=10, vocab=vocab)
    drafter = DraftHeadDrafter(head, k=4)
    prompt = _prompts(1, seed=4)[0]
    sp = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=30, stop_on_eos=False)
    assert sp.tokens == generate(tiny_target, prompt, max_new_tokens=30, stop_on_eos=False).tokens
    drafted = {t for s in sp.steps for t in s.draft_tokens}
    assert drafted and drafted <= set(vocab.tolist())


def test_unroll_mask_is_a_draft_from_each_root():
    m = unroll_mask(5, 3, torch.float64)[0, 0] == 0  # [5, 15]
    # step 3's query at u=4 sees the target-feature entries 0..2 (root 2), step 2's entry at 3, its own at 4
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert m[0].nonzero().flatten().tolist() == [10]


def test_unrolled_step_equals_drafting(tiny_target, head):
    """Row u of unrolled step s is what drafting s tokens deep from root u - s + 1 computes."""
    seq = _prompts(1, seed=9)[0] + list(range(10))
    chunk = Chunk(torch.tensor(seq), target_features(tiny_target, seq))
    with torch.no_grad():
        outs = unroll(head, tiny_target, chunk, 3)
    u, s = 7, 3
    root = u - s + 1
    cache = head.new_cache()
    with torch.no_grad():
        f = head(tiny_target, chunk.features[: root + 1], chunk.tokens[1 : root + 2], torch.arange(root + 1), cache)[-1]
        for pos in range(root + 1, u + 1):
            f = head(tiny_target, f[None], chunk.tokens[pos + 1 : pos + 2], torch.tensor([pos]), cache)[-1]
    torch.testing.assert_close(outs[s - 1][u], f, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_then_run_loads_the_written_weights(tmp_path, tiny_target, precision):
    from cascade.train_head import train

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train_head", overrides=["debug=tiny", "progress=false", f"output_dir={tmp_path / 'out'}",
                                               f"train.save_to={tmp_path / 'head.pt'}", "train.max_tokens=1200",
                                               f"train.features_dir={tmp_path / 'features'}",
                                               f"train.precision={precision}"])
    summary = train(cfg)
    assert len(summary["metrics"]["agreement"]) == 4 and summary["metrics"]["train_tokens"] > 0
    assert summary["metrics"]["precision"] == precision and summary["metrics"]["feature_storage"] == "float16"
    assert summary["metrics"]["history"][-1]["train_tokens_per_s"] > 0
    written = torch.load(tmp_path / "head.pt", weights_only=True)
    from cascade.models import load_model

    target = load_model(cfg.models.target, cfg.models.backend)
    drafter = DraftHeadDrafter(str(tmp_path / "head.pt"), k=3)
    drafter.check_compatible(target)
    state = drafter.head.state_dict()
    for k, v in written["state_dict"].items():
        assert torch.equal(state[k].float(), v), k
    assert torch.equal(drafter.head.vocab.cpu(), written["vocab"])
    prompt = target.encode("def f(x):")
    assert generate(target, prompt, drafter=drafter, max_new_tokens=12).tokens == generate(target, prompt, max_new_tokens=12).tokens
    # the features are cached: a second training reuses them (no new capture)
    files = sorted((tmp_path / "features").rglob("chunk_*.pt"))
    mtimes = [f.stat().st_mtime_ns for f in files]
    train(cfg)
    assert [f.stat().st_mtime_ns for f in files] == mtimes


def test_an_interrupted_training_run_resumes_bitwise(tmp_path, monkeypatch):
    """Killed during its second epoch's evaluation, the run continues from the first epoch's
    progress on the same command and ends bitwise where an uninterrupted run ends; other
    settings are refused (resume=true) or start afresh (auto)."""
    import cascade.train_head as th
    from cascade.run import ConfigError

    def cfg(out, *extra):
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            return compose("train_head", overrides=["debug=tiny", "progress=false", f"output_dir={tmp_path / out}",
                                                    "train.save_to=null", "train.max_tokens=1200", "train.epochs=3",
                                                    f"train.features_dir={tmp_path / 'features'}", *extra])

    whole = th.train(cfg("whole"))
    evaluations, real = [], th.agreement

    def dies_at_the_third(*args, **kwargs):  # before training, after epoch 0, after epoch 1 (killed)
        evaluations.append(1)
        if len(evaluations) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(th, "agreement", dies_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        th.train(cfg("cut"))
    monkeypatch.setattr(th, "agreement", real)
    assert th.TrainProgress.load(tmp_path / "cut" / "train_state.pt").epochs_done == 1
    with pytest.raises(ConfigError, match="lr"):
        th.train(cfg("cut", "train.resume=true", "train.lr=1e-3"))
    resumed = th.train(cfg("cut", "train.resume=true"))
    a, b = whole["metrics"], resumed["metrics"]
    assert [h["steps"] for h in b["history"]] == [h["steps"] for h in a["history"]]
    assert [h["agreement"] for h in b["history"]] == [h["agreement"] for h in a["history"]]
    assert [h["loss"] for h in b["history"]] == [h["loss"] for h in a["history"]]
    ours, theirs = (torch.load(tmp_path / d / "head.pt", weights_only=True)["state_dict"] for d in ("whole", "cut"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # a run that starts afresh (other settings, resume=auto) trains all its epochs again
    fresh = th.train(cfg("cut", "train.lr=1e-3"))
    assert [h["epoch"] for h in fresh["metrics"]["history"]] == [0, 1, 2]
    with pytest.raises(ConfigError, match="does not exist"):
        th.train(cfg("nowhere", "train.resume=true"))


def _bound(head, target, context):
    from cascade.drafters.base import DraftStart
    from cascade.types import SamplingConfig

    drafter = DraftHeadDrafter(head)
    drafter.check_compatible(target)
    drafter.start(DraftStart(target, None, context, SamplingConfig(), None, target_features(target, context[:-1])))
    return drafter


@pytest.mark.parametrize("one_call", [False, True])
def test_tree_levels_equal_each_path_drafted_alone(one_call, tiny_target, head):
    """Level by level, or every node in one call (parents first: a policy feeding a path another
    drafter proposed), each node's logits are the head's after drafting its path alone."""
    import random

    from cascade.tree_structure import depths_of, path_to
    from test_tree_levels import grow_by_levels, random_tree

    rng = random.Random(3)
    context = [rng.randrange(32) for _ in range(7)]
    tokens, parents = random_tree(rng, 12, 32)
    drafter = _bound(head, tiny_target, context)
    if one_call:
        order = sorted(range(len(tokens)), key=lambda i: (depths_of(parents)[i], i))
        got = {-1: drafter.tree_start(context)}
        rows = drafter.tree_level(order, [tokens[i] for i in order], [parents[i] for i in order])
        got.update({i: rows[r] for r, i in enumerate(order)})
    else:
        got = grow_by_levels(drafter, context, tokens, parents)
    drafter.tree_end()
    reference = _bound(head, tiny_target, context)
    for node, logits in got.items():
        path = [tokens[j] for j in path_to(node, parents)] if node != -1 else []
        want = reference.score(context, path)[-1]
        torch.testing.assert_close(logits, want, atol=1e-9, rtol=0)


def test_training_tuples_align_with_transformers_own_model(tiny_target):
    """The (feature, next token, target feature, teacher) tuples chunk_loss trains on equal what
    transformers' own forward gives at the same positions: its last hidden state (after the final
    norm) and its logits; paired one position off they would not."""
    from cascade.models.layers import decoder_parts

    ids = torch.randint(0, tiny_target.vocab_size, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    feats = target_features(tiny_target, ids)  # [T, H] what capture_features stores
    teacher = torch.softmax(feats[1:] @ decoder_parts(tiny_target).head.weight.T, -1)  # [T-1, V] chunk_loss's teacher
    with torch.no_grad():
        out = tiny_target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hf_feats, hf_probs = out.hidden_states[-1][0], torch.softmax(out.logits[0], -1)  # [T, H], [T, V]
    torch.testing.assert_close(feats, hf_feats, atol=1e-10, rtol=0)
    # head position u: input (f_u, x_{u+1}); target feature f_{u+1}; teacher = the target's law of x_{u+2}
    torch.testing.assert_close(teacher, hf_probs[1:], atol=1e-10, rtol=0)
    assert (feats[1:] - hf_feats[:-1]).abs().max() > 1e-2  # the pairing is not shift-invariant
    # the token fed beside f_u is the one the target read at u + 1
    chunk = Chunk(torch.tensor(ids), feats)
    assert chunk.tokens[1:].tolist() == ids[1:]


def test_features_stored_in_16_bits_round_on_load(tmp_path, tiny_target):
    """A cache written in float32 serves a float16 run with exactly what a fresh float16 capture
    writes (the same rounding), and a float16 capture writes half-size files."""
    from cascade.head_training import capture_features

    chunks = [list(range(5, 25)), list(range(31, 19, -1))]
    wide = capture_features(tiny_target, chunks, {"x": 1.0}, 32, tmp_path / "a", progress=False)
    assert all(c.features.dtype == torch.float32 for c in wide)
    reread = capture_features(tiny_target, chunks, {"x": 1.0}, 32, tmp_path / "a", progress=False, storage=torch.float16)
    fresh = capture_features(tiny_target, chunks, {"x": 1.0}, 32, tmp_path / "b", progress=False, storage=torch.float16)
    for w, r, f in zip(wide, reread, fresh):
        assert r.features.dtype == f.features.dtype == torch.float16
        assert torch.equal(r.features, f.features) and torch.equal(r.features, w.features.half())
    saved = torch.load(tmp_path / "b" / "chunk_00000.pt", weights_only=True)["features"]
    assert saved.dtype == torch.float16


def test_capture_copies_chunks_of_earlier_captures(tmp_path, tiny_target, monkeypatch):
    """A larger corpus whose chunks include a smaller capture's copies those files (computing
    only the new chunks) and gets exactly a fresh capture's features; a capture of another
    target is never a source."""
    import json

    from cascade import head_training

    small = [list(range(5, 25)), list(range(31, 19, -1))]
    large = [small[1], list(range(2, 18)), small[0]]  # another order, one new chunk
    head_training.capture_features(tiny_target, small, {"x": 1.0}, 32, tmp_path / "small", progress=False)
    other = tmp_path / "other"  # the same tokens captured for another target: must not be used
    head_training.capture_features(tiny_target, small, {"x": 1.0}, 32, other, progress=False)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "target": "another"}))
    computed = []
    real = head_training.target_features
    monkeypatch.setattr(head_training, "target_features", lambda lm, ids, layers=(): computed.append(ids) or real(lm, ids, layers))
    got = head_training.capture_features(tiny_target, large, {"x": 1.0}, 32, tmp_path / "large", progress=False,
                                         reuse_dirs=[other, tmp_path / "small"])
    assert computed == [large[1]]
    fresh = head_training.capture_features(tiny_target, large, {"x": 1.0}, 32, tmp_path / "fresh", progress=False)
    assert len(computed) == 4  # the fresh capture computed all three
    for g, f in zip(got, fresh):
        assert g.tokens.tolist() == f.tokens.tolist() and torch.equal(g.features, f.features)
    computed.clear()
    head_training.capture_features(tiny_target, large, {"x": 1.0}, 32, tmp_path / "none", progress=False,
                                   reuse_dirs=[other])  # only another target's capture: everything computed
    assert len(computed) == 3


def test_continuation_drafter_is_a_drafter_config_built_on_demand():
    from omegaconf import OmegaConf

    from cascade.run import ConfigError
    from cascade.train_head import _drafter_factory

    assert _drafter_factory(None) is None
    make = _drafter_factory(OmegaConf.create({"_target_": "cascade.drafters.NGramDrafter", "k": 2}))
    assert isinstance(make(), NGramDrafter) and make().k == 2
    with pytest.raises(ConfigError, match="_target_"):
        _drafter_factory(OmegaConf.create({"k": 2}))


def test_bf16_training_steps_run_in_bf16_with_fp32_losses():
    """Under the bf16 autocast that train.precision=bf16 turns on, the head's matmuls run in bf16
    while the loss (softmaxes, regression) and the parameters' gradients stay fp32."""
    from cascade.head_training import chunk_loss
    from cascade.models.layers import decoder_parts
    from cascade.train_head import training_autocast

    assert training_autocast("fp32", torch.device("cpu")) is None
    assert training_autocast("bf16", torch.device("cpu")) is torch.bfloat16
    target = tiny_llama(seed=0, dtype="float32")
    head = DraftHead.from_target(target, None, seed=0)
    ids = list(range(3, 40))
    chunk = Chunk(torch.tensor(ids), target_features(target, ids))
    rows = decoder_parts(target).head.weight.detach()
    seen = []
    hook = head.fc.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, hits = chunk_loss(head, target, chunk, rows, 2, 1.0)
    hook.remove()
    assert seen == [torch.bfloat16] * 2 and loss.dtype == torch.float32 and len(hits) == 2
    loss.backward()
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    fp32_loss, _ = chunk_loss(head, target, chunk, rows, 2, 1.0)
    got, want = loss.detach().item(), fp32_loss.detach().item()
    assert abs(got - want) < 0.05 * want  # bf16 rounding, not another loss


def test_continuations_are_greedy_cached_and_resumable(tmp_path, monkeypatch):
    """The continuations source: prompt + the target's greedy continuation, generated lazily
    (only as far as a consumer reads), appended to a cache a rerun reads instead of generating;
    a torn last line is generated again; corpus_chunks draws the source's budget from it."""
    import itertools
    import json

    from cascade import continuations as cont
    from cascade.data import continuation_prompts
    from cascade.head_training import ContinuationSource, corpus_chunks
    from cascade.models import load_model

    lm = load_model("tiny:0", backend="float32")
    first = list(itertools.islice(cont.continuations(lm, 4, root=tmp_path, progress=False), 3))
    path = cont.cache_file(lm, 4, tmp_path)
    assert len(path.read_text().splitlines()) == 3  # lazy: three read, three generated
    for p, text in zip(continuation_prompts()[:3], first):
        ids = lm.encode(p.text)[-(lm.max_context - 4):]
        assert text == ids + generate(lm, ids, max_new_tokens=4).tokens  # greedy, after the prompt
    with open(path, "a") as f:
        f.write('{"format": "cascade.continuations/1", "id": "')  # an interrupted append
    calls = []
    real = cont.generate
    monkeypatch.setattr(cont, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = list(itertools.islice(cont.continuations(lm, 4, root=tmp_path, progress=False), 4))
    assert again[:3] == first and len(calls) == 1  # only the fourth is generated
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()[:3]] == [p.id for p in continuation_prompts()[:3]]
    monkeypatch.setenv("CASCADE_CACHE", str(tmp_path / "cache"))
    chunks = corpus_chunks(lm, {"continuations": 1.0}, 64, 600, seed=0, continuation=ContinuationSource(4),
                           progress=False)
    assert 550 <= sum(map(len, chunks)) <= 600
    texts = list(itertools.islice(cont.continuations(lm, 4, progress=False), 10))
    joined = [t for text in texts for t in text]
    assert all(any(c == joined[i:i + len(c)] for i in range(len(joined))) for c in chunks)
    with pytest.raises(ValueError, match="new_tokens"):
        next(cont.continuations(lm, 0, root=tmp_path))
    # another drafter writes the same text; it is built once, and not at all when the cache has it all
    built = []

    def small_lm():
        built.append(1)
        return SmallLMDrafter(load_model("tiny:1", backend="float32"), k=3)

    drafted = list(itertools.islice(cont.continuations(lm, 4, root=tmp_path / "lm", progress=False,
                                                       make_drafter=small_lm), 3))
    assert drafted == first and len(built) == 1
    list(itertools.islice(cont.continuations(lm, 4, root=tmp_path / "lm", progress=False, make_drafter=small_lm), 3))
    assert len(built) == 1
