"""analysis.throughput: whole-call and decode tokens per second from a summary."""

import pytest

from analysis.throughput import throughput_rows


def test_decode_time_leaves_out_every_prefill():
    stats = {"tau": None, "tokens_per_s": 5.0, "new_tokens": 40, "wall_time_s": 8.0, "prefill_time_s": 2.0,
             "drafter_prefill_time_s": 1.0}
    summary = {"methods": {"peer": {"stats": stats, "speedup": 1.2, "decode_speedup": 1.1, "identical_to_baseline": 3}}}
    ((name, tau, whole, decode, speedup, dspeed, same),) = throughput_rows(summary)
    assert (name, tau, whole, speedup, dspeed, same) == ("peer", None, 5.0, 1.2, 1.1, 3)
    assert decode == pytest.approx(40 / 5.0)
