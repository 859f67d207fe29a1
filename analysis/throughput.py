"""Each method's tokens per second of a run, whole call and decode alone (new tokens over the time
after the prefills: the target's, the drafter's, or a peer program's own prompt time), with
its speedups and how many prompts' greedy output equals the baseline's.

    python -m analysis.throughput RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

from analysis.summaries import each_run


def throughput_rows(summary: dict) -> list[tuple]:
    """(method, τ or None, tok/s whole, tok/s decode, speedup, decode speedup, prompts equal to the baseline)."""
    rows = []
    for name, m in summary["methods"].items():
        st = m["stats"]
        decode_s = st["wall_time_s"] - st["prefill_time_s"] - st["drafter_prefill_time_s"]
        rows.append((name, st["tau"], st["tokens_per_s"], st["new_tokens"] / decode_s, m["speedup"], m["decode_speedup"],
                     m["identical_to_baseline"]))
    return rows


def main() -> None:
    for run, summary in each_run(__doc__):
        print(run)
        print("| method | τ | tok/s whole | tok/s decode | speedup whole | decode | same as `ar` |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, tau, whole, decode, speedup, dspeed, same in throughput_rows(summary):
            print(f"| {name} | {'-' if tau is None else f'{tau:.2f}'} | {whole:.1f} | {decode:.1f} | {speedup:.2f}x | {dspeed:.2f}x | {same} |")


if __name__ == "__main__":
    main()
