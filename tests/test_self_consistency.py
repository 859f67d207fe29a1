"""analysis.self_consistency: a peer program's speculative methods against its own autoregressive
method of the same run."""

from analysis.self_consistency import first_difference, self_consistency


def _method(kind, tokens):
    return {"drafter": {"kind": kind}, "tokens": tokens}


def test_peer_speculation_is_compared_with_its_own_autoregressive_output():
    summary = {"methods": {
        "ar": _method("autoregressive", {"p0": [1, 2, 3], "p1": [4, 5]}),
        "chain": _method("small_lm", {"p0": [1, 2, 3], "p1": [4, 5]}),
        "llamacpp_ar": _method("llamacpp:ar", {"p0": [1, 2, 9], "p1": [4, 5, 6]}),
        "llamacpp_spec": _method("llamacpp:draft-simple", {"p0": [1, 2, 9], "p1": [4, 7, 6]}),
        "llamacpp_short": _method("llamacpp:ngram-mod", {"p0": [1, 2], "p1": [4, 5, 6]}),
    }}
    rows = {r.method: r for r in self_consistency(summary)}
    assert set(rows) == {"llamacpp_spec", "llamacpp_short"}  # cascade's own methods and the peer's AR are not rows
    assert rows["llamacpp_spec"].baseline == "llamacpp_ar" and rows["llamacpp_spec"].differing == [("p1", 1)]
    assert rows["llamacpp_short"].differing == [("p0", 2)]  # a shorter output differs where it ends
    assert first_difference([1, 2], [1, 2]) is None
