"""Cost models (cascade/costs.py): the roofline, the device table, the virtual clock; the guard's
pure functions (cascade/trees/guard.py); the roofline check and the calibration table of
analysis/ on a virtual-clock run."""

import dataclasses
import math

import pytest
from torch import nn

import cascade.run as run_mod
from analysis import rounds
from analysis.roofline import check
from cascade import generate
from cascade.costs import DEVICES, Device, ForwardShape, MeasuredCosts, RooflineCosts, VirtualClock, linear_bytes
from cascade.drafters import SmallLMDrafter
from cascade.results import load_jobs
from cascade.trees.drafter import TreeDrafter
from cascade.trees import DynamicTreePolicy
from cascade.trees.growth import Tree
from cascade.trees.guard import RealisedCheck, Valued, best_chain, keep_tree
from tests.test_experiments import _cfg

DEV = Device("d", bandwidth=1e9, peak_flops=1e9, forward_overhead_s=1e-3, layer_overhead_s=1e-4, host_step_s=0.0,
             lookup_s=0.0, kv_bytes=2, source="test", measured=False)


def test_every_device_states_its_source():
    for name, d in DEVICES.items():
        assert d.source and d.bandwidth > 0 and d.peak_flops > 0, name
    assert not DEVICES["h100"].measured and "datasheet" in DEVICES["h100"].source
    assert not DEVICES["a100"].measured and DEVICES["zen5_epyc"].measured
    with pytest.raises(ValueError, match="unknown device"):
        RooflineCosts("tpu9", ForwardShape(1, 1, 1, 1, 1), {})


def test_roofline_is_bandwidth_then_compute_bound():
    shape = ForwardShape(weight_bytes=1e6, weight_count=1e5, layers=2, kv_values_per_position=0,
                         attention_flops_per_position=0)
    t = [shape.seconds(DEV, n, 0) for n in (1, 2, 5, 10, 20)]
    overhead = 1e-3 + 2e-4
    assert t[0] == pytest.approx(overhead + 1e-3)  # 1 MB at 1 GB/s
    assert t[2] == pytest.approx(overhead + 1e-3)  # 5 inputs x 2e5 FLOP = 1e6 FLOP: still the bytes
    assert t[3] == pytest.approx(overhead + 2e-3) and t[4] == pytest.approx(overhead + 4e-3)  # compute-bound
    additive = dataclasses.replace(DEV, overlap=False)  # reads and arithmetic add (zen3_epyc's measured curve)
    t = [shape.seconds(additive, n, 0) for n in (1, 5, 10)]
    assert t == [pytest.approx(overhead + 1e-3 + n * 2e-4) for n in (1, 5, 10)]


def test_shapes_count_the_bytes_as_loaded():
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Linear(8, 2))
    assert linear_bytes(model) == (4 * (32 + 16 + 2), 32 + 16)
    model.half()
    assert linear_bytes(model)[0] == 2 * (32 + 16 + 2)


def test_measured_costs_have_errors_and_roofline_costs_none(tiny_target):
    m = MeasuredCosts()
    assert m.verify(1) is None and not m.predicts
    for x in (0.10, 0.11, 0.09, 0.10):
        m.observe_verify(1, x)
    assert m.verify(1).seconds == pytest.approx(0.10) and m.verify(1).sd > 0
    r = RooflineCosts(DEV, ForwardShape.of(tiny_target), {"d": ForwardShape.of(tiny_target)})
    assert r.predicts and r.verify(3).sd == 0 and r.verify(2).seconds <= r.verify(3).seconds
    r.observe_verify(1, 99.0)  # a measurement says nothing of a named device
    assert r.verify(1).seconds < 1 and r.forward("d", 2).seconds > 0 and r.forward("other", 1) is None


def test_virtual_clock_prices_every_forward_and_keeps_the_tokens(tiny_target, tiny_close_drafter):
    prompt = [1, 2, 3, 4, 5]
    shape = ForwardShape.of(tiny_target)
    clock = VirtualClock(DEV)
    out = generate(tiny_target, prompt, max_new_tokens=6, stop_on_eos=False, clock=clock)
    ref = generate(tiny_target, prompt, max_new_tokens=6, stop_on_eos=False)
    assert out.tokens == ref.tokens and out.clock == "predicted:d" and ref.clock == "measured"
    expected = shape.seconds(DEV, 4, 0) + sum(shape.seconds(DEV, 1, 4 + i) for i in range(6))  # prefill + 6 steps
    assert out.wall_time_s == pytest.approx(expected)
    assert [f.inputs for s in out.steps for f in s.forwards] == [1] * 6 and out.forward_shapes[tiny_target.name] == shape
    spec = generate(tiny_target, prompt, drafter=SmallLMDrafter(tiny_close_drafter, k=3), max_new_tokens=12,
                    stop_on_eos=False, clock=VirtualClock(DEV))
    assert spec.tokens == generate(tiny_target, prompt, max_new_tokens=12, stop_on_eos=False).tokens
    for s in spec.steps:  # every step's time is its forwards' roofline, nothing measured
        priced = sum(spec.forward_shapes[f.model].seconds(DEV, f.inputs, f.context) for f in s.forwards)
        assert s.step_time_s == pytest.approx(priced)


def _tree(spec):
    """A tree from (parent, rank, reach) triples."""
    t = Tree([0])
    for parent, rank, reach in spec:
        t.add(parent, drafter=0, rank=rank, token=len(t.nodes), q=None, reach=reach)
    return t


def test_best_chain_and_the_guard():
    tree = _tree([(-1, 1, 0.9), (0, 1, 0.8), (-1, 2, 0.05), (1, 1, 0.1), (2, 1, 0.04)])
    chain = best_chain(tree, drafting=0.3, verify_cost=lambda n: (1.0 + 0.1 * n, 0.0))
    assert chain.nodes == [0, 1]  # the deepest first child does not pay; the sibling's subtree is no chain
    assert chain.gain == pytest.approx(2.7) and chain.cost == pytest.approx(1.5)
    whole = Valued(list(range(5)), 1 + 0.9 + 0.8 + 0.05 + 0.1 + 0.04, 0.3 + 1.5, 0.0)
    assert not keep_tree(whole, chain, margin=1.0, min_gain=0.02)
    rich = Valued(list(range(5)), 4.0, 1.8, 0.0)
    assert keep_tree(rich, chain, margin=1.0, min_gain=0.02)
    assert not keep_tree(rich, Valued([0], 2.0, 1.0, sd=0.5), margin=1.0, min_gain=0.0)  # within the noise: the chain


def test_realised_check_starts_on_chains_then_follows_the_outcomes():
    check_ = RealisedCheck(window=8, probe=8, min_steps=2)
    modes = [check_.next_mode() for _ in range(8)]
    assert modes == ["chain", "tree"] * 4  # chains by default; trees every probe // 4 (= 2) steps until measured
    check_ = RealisedCheck(window=8, probe=4, min_steps=2)
    for _ in range(8):
        check_.record(3 if check_.next_mode() == "chain" else 1, 1.0)  # chains deliver 3 tokens/s, trees 1
    picked = [check_.next_mode() for _ in range(8)]
    assert picked.count("chain") == 6 and picked.count("tree") == 2  # trees only on probe steps
    assert check_.snapshot() == {"tree_tokens_per_s": 1.0, "tree_tokens_per_s_se": 0.0,
                                 "chain_tokens_per_s": 3.0, "chain_tokens_per_s_se": 0.0}  # steady outcomes: no spread
    check_ = RealisedCheck(window=8, probe=4, min_steps=2)
    for _ in range(8):
        check_.record(1 if check_.next_mode() == "chain" else 3, 1.0)  # trees deliver more: trees are drafted
    picked = [check_.next_mode() for _ in range(8)]
    assert picked.count("tree") == 6 and picked.count("chain") == 2
    with pytest.raises(ValueError):
        RealisedCheck(probe=1)


def test_device_run_is_labelled_a_prediction_and_analysed(tmp_path, capsys):
    cfg = _cfg("+experiment=dytc_tree", "debug=tiny", f"output_dir={tmp_path}", "progress=false", "device_model=h100")
    summary = run_mod.run(cfg)
    assert summary.clock.startswith("predicted:NVIDIA H100")
    out = capsys.readouterr().out
    assert "PREDICTED, not measured" in out and "pred tok/s" in out
    assert summary.methods["dytc_tree"].identical_to_baseline == len(summary.methods["dytc_tree"].tokens)
    jobs, _ = load_jobs(tmp_path)
    steps = jobs[0].steps()
    assert all(s["forwards"] for s in steps) and set(summary.forward_shapes) >= {f["model"] for s in steps for f in s["forwards"]}
    table = rounds.calibration(steps)["dytc_tree"]
    assert table["rounds as chains"]["judged"] > 0
    rows = check(steps, summary.forward_shapes, "ar", DEVICES["h100"])
    assert rows["ar"]["measured"] == pytest.approx(1.0) and math.isfinite(rows["dytc_tree"]["fitted"])


def test_device_run_refuses_unpriceable_methods_and_unknown_devices(tmp_path):
    with pytest.raises(run_mod.ConfigError, match="unknown device"):
        run_mod.run(_cfg("+experiment=ar", "debug=tiny", f"output_dir={tmp_path}", "device_model=tpu9"))
    with pytest.raises(run_mod.ConfigError, match="virtual clock cannot price"):
        run_mod.run(_cfg("method=hf_ar", "debug=tiny", f"output_dir={tmp_path}", "device_model=h100"))


def test_dytc_on_a_device_prices_from_its_roofline(tiny_target, tiny_close_drafter):
    policy = DynamicTreePolicy(device=DEV)
    drafter = TreeDrafter([SmallLMDrafter(tiny_close_drafter)], policy)
    generate(tiny_target, [1, 2, 3], drafter=drafter, max_new_tokens=10, stop_on_eos=False, clock=VirtualClock(DEV))
    costs = policy.prices.costs
    assert costs.predicts and costs.context > 3  # priced at the context of the last tree grown
    assert costs.verify(1).seconds == ForwardShape.of(tiny_target).seconds(DEV, 1, costs.context)


def test_guarantee_table_matches_trees_to_their_drafters_chains(tmp_path):
    from analysis.guarantee import contained_chains, rows

    cfg = _cfg("+experiment=bench/dytc_device", "debug=tiny", f"output_dir={tmp_path}", "progress=false",
               "device_model=h100", "dataset.num_prompts=2")
    summary = run_mod.run(cfg)
    trees = contained_chains(summary.methods)
    assert set(trees["dytc_tree"]) == {"chain_k4", "chain_k6", "chain_k8", "pld"}
    assert set(trees["dytc_head"]) == {"eagle_chain"}
    assert set(trees["dytc_head_quant"]) == {"eagle_chain", "chain_k4", "chain_k6", "chain_k8", "pld"}
    jobs, _ = load_jobs(tmp_path)
    table = {r["method"]: r for r in rows(jobs[0])}
    best = max(summary.methods[c].decode_speedup for c in trees["dytc_tree"])
    assert table["dytc_tree"]["vs_decode"] == pytest.approx(summary.methods["dytc_tree"].decode_speedup / best)
    from analysis.guarantee import twins

    assert twins(summary.methods) == []  # no two of these draft alike
    renamed = dict(summary.methods, chain_k8_again=summary.methods["chain_k8"])
    assert twins(renamed) == [("chain_k8", "chain_k8_again")]  # an A/A control is found


def test_spine_depth_rate_is_validated_and_keeps_trees_lossless(tiny_target, tiny_close_drafter):
    with pytest.raises(ValueError, match="depth_rate"):
        DynamicTreePolicy(depth_rate="level")
    drafter = TreeDrafter([SmallLMDrafter(tiny_close_drafter)], DynamicTreePolicy(device=DEV, depth_rate="spine"))
    out = generate(tiny_target, [1, 2, 3], drafter=drafter, max_new_tokens=16, stop_on_eos=False, clock=VirtualClock(DEV))
    assert out.tokens == generate(tiny_target, [1, 2, 3], max_new_tokens=16, stop_on_eos=False).tokens


def test_roofline_fit_per_part_follows_a_host_whose_arithmetic_and_reads_drift_apart():
    """Steps timed on a 'host' whose reads run at 0.9 of the device's roof and whose arithmetic at 0.6 of
    its peak (its cores shared): the fit per part, on the first half of the prompts,
    predicts the second half's speedups; one scale per model cannot (it moves a forward of eight
    inputs as far as a forward of one)."""
    import random

    from analysis.roofline import fit_parts

    device = dataclasses.replace(DEVICES["zen4_epyc"], host_step_s=0.0)
    target = ForwardShape(3.0e9, 1.5e9, 28, 2 * 28 * 256, 4.0 * 28 * 1536)
    drafter = ForwardShape(0.3e9, 0.5e9, 24, 2 * 24 * 128, 4.0 * 24 * 896)
    shapes = {"t": target, "d": drafter}
    reads, arithmetic = 0.9, 0.6  # of the device's roof and peak
    host = dataclasses.replace(device, bandwidth=reads * device.bandwidth, peak_flops=arithmetic * device.peak_flops)
    rng, steps = random.Random(0), []
    for p in range(8):
        for method, inputs, tokens in (("ar", 1, 1), ("chain_k4", 5, 3), ("chain_k8", 9, 4)):
            for i in range(20):
                forwards = [{"model": "t", "inputs": inputs, "context": 100 + i}]
                forwards += [{"model": "d", "inputs": 1, "context": 100 + i}] * (inputs - 1)
                seconds = sum(shapes[f["model"]].seconds(host, f["inputs"], f["context"]) for f in forwards)
                steps.append({"method": method, "prompt": f"p{p}", "emitted": tokens, "forwards": forwards,
                              "step_time_s": seconds * (1 + 0.02 * rng.uniform(-1, 1))})
    rows = check(steps, shapes, "ar", device)
    for m in ("chain_k4", "chain_k8"):
        assert rows[m]["per_part"] == pytest.approx(rows[m]["measured"], rel=0.03), rows[m]
        assert abs(rows[m]["in_sample_error"]) < 0.03  # and on the half it was fitted on
    assert max(abs(rows[m]["fitted"] / rows[m]["measured"] - 1) for m in ("chain_k4", "chain_k8")) > 0.05
    parts = fit_parts(steps, shapes, device)
    assert parts.reads["t"] == pytest.approx(1 / reads, rel=0.05)
    assert parts.reads["t"] * parts.ratio["t"] == pytest.approx(1 / arithmetic, rel=0.15)
