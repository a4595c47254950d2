"""`jaxinfer bench`'s figures against hand counts and independent computations on made-up times.

The smoke runs in test_llm.py and test_serving.py can only check signs and orders of figures that
vary with the machine; here each formula is pinned: the bytes a decode step reads and the FLOPs of
a prefill on a tied sliding-window model, the --vs-hf ratios, the throughput mode's rounds, the
profile summary, the throughput timers' gaps, and the serve bench's summary and round comparison.
"""

import argparse
import gzip
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from jaxinfer import bench


def _bench_args(argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


class _Clock:
    """A perf_counter that moves only when told to."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.mark.parametrize("tied, dtype, itemsize", [(True, "float32", 4), (False, "bfloat16", 2)])
def test_prefill_flops_and_step_bytes_of_a_sliding_window_model(monkeypatch, tmp_path, tied, dtype, itemsize):
    """A Mistral with an 8-key window on every layer (vocabulary 128, hidden 64, MLP 160, 2 layers,
    4 query / 2 KV heads of 16), its LM head tied to the embedding table or not, counted by hand.

    Prefill: a query sees at most 8 keys (its tiled attention skips the tiles before the window), so
    a 20-token prompt has 36 + 12 x 8 causal pairs per layer, not the triangle's 210; the head is
    charged once. Decode: the step reads every weight but an untied embedding table (a tied one is
    the LM head), in the run's dtype, and each row's K/V over min(context, 8) tokens per layer,
    averaged over the window's steps: from context 6 with 6 new tokens the steps read 7, 8, 8, 8, 8
    keys (mean 7.8), not min(6 + 3, 8) = 8."""
    from hf_models import make_hf_model, save_hf_model

    save_hf_model(make_hf_model("mistral-swa", tie_word_embeddings=tied), tmp_path)
    ceilings = iter([2e9, 2e9, 4e9, 2e9, 5e9])  # before; before each of 3 runs; after (the best)

    class Ceiling:
        def measure(self, repeats=5):
            return {"reduce": next(ceilings)}

    monkeypatch.setattr(bench, "ReadCeiling", Ceiling)
    runs = iter([(0.01, 1.0, 2.0), (0.04, 1.0, 2.0), (0.02, 1.0, 2.0)])  # step s, total s, rows per step
    monkeypatch.setattr(bench, "_decode_once", lambda *a: next(runs))
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: None)
    monkeypatch.setattr(bench, "_sampler_times", lambda *a: [])
    argv = ["--model", str(tmp_path), "--prompt-lens", "20", "--batch-sizes", "2", "--dtype", dtype]
    report = bench.run(_bench_args(argv + ["--context", "6", "--new-tokens", "6", "--repeats", "3"]))

    d, f, v, layers, heads, kv_heads, hd = 64, 160, 128, 2, 4, 2, 16
    per_layer = 2 * d * heads * hd + 2 * d * kv_heads * hd + 3 * d * f + 2 * d  # q, o; k, v; MLP; 2 norms
    tables = 1 if tied else 2  # the embedding table, and the LM head unless tied
    weights = itemsize * (tables * v * d + layers * per_layer + d)  # + the layers and the final norm
    assert report["weight_bytes"] == weights
    (row,) = report["ttft"]
    attention = 2 * 2 * layers * heads * hd * (8 * 9 // 2 + 12 * 8)  # QK^T and PV over the pairs
    assert row["flops"] == 2 * (layers * per_layer + d) * 20 + 2 * v * d + attention

    kv_per_key = 2 * kv_heads * hd * itemsize  # K and V of one layer
    streamed = weights - (0 if tied else itemsize * v * d)
    step_bytes = streamed + 2.0 * layers * kv_per_key * np.mean([7, 8, 8, 8, 8])
    (row,) = report["decode"]
    assert row["GBps"] == pytest.approx(step_bytes / 0.02 / 1e9, rel=1e-12)  # the median step
    # The median of each run against the ceiling just before it (not their mean), and the median
    # run against the best ceiling of the whole run, the one measured after the decode runs.
    paired = [step_bytes / 0.01 / 2e9, step_bytes / 0.04 / 4e9, step_bytes / 0.02 / 2e9]
    assert row["mbu"] == pytest.approx(np.median(paired), rel=1e-12)
    assert row["mbu_vs_best"] == pytest.approx(step_bytes / 0.02 / 5e9, rel=1e-12)
    assert report["read_bandwidth_GBps"] == {"reduce": 5.0}


def test_causal_pairs_against_a_mask():
    """`causal_pairs` against the pairs a mask of (p - window, p] actually admits, counted by NumPy."""
    from jaxinfer.config import GlobalAttention, SlidingWindow

    for n in (1, 5, 8, 9, 31):
        kinds = (SlidingWindow(8), GlobalAttention(), SlidingWindow(1), SlidingWindow(40))
        cfg = SimpleNamespace(num_layers=len(kinds), attention_kind=kinds.__getitem__)
        p, k = np.arange(n)[:, None], np.arange(n)[None, :]
        want = sum(int(((k <= p) & (p - k < getattr(kind, "window", n + 1))).sum()) for kind in kinds)
        assert bench.causal_pairs(cfg, n) == want, n


def test_vs_hf_ratios_on_a_made_up_clock(monkeypatch):
    """--vs-hf on made-up times: HF's step from its first to its last token's timestamp over the
    n - 1 gaps, both sides' medians over the repeats, the ratios ours over HF's (above 1: ours is
    faster) for decode tok/s and HF's total over ours for the whole call, on the same prompts."""
    import transformers

    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    hf_steps = iter([0.5, 0.1, 0.3, 0.2])  # warm-up, then 3 repeats: median 0.2
    seen = []

    class FakeHF:
        def eval(self):
            return self

        def to(self, device):
            return self

        def generate(self, ids, *, max_new_tokens, stopping_criteria, **kw):
            seen.append(ids.tolist())
            step = next(hf_steps)
            clock.now += 1.0  # the prompt, and its first token
            for i in range(max_new_tokens):
                clock.now += step if i else 0.0
                stopping_criteria[0](ids, None)
            clock.now += 0.05  # the rest of generate's own work

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: FakeHF())
    ours = iter([(0.02, 0.5, 1.5), (0.04, 0.7, 1.0), (0.03, 0.6, 2.0)])  # step s, total s, rows per step
    mine = []
    monkeypatch.setattr(bench, "_decode_once", lambda llm, prompts, params: (mine.append(prompts), next(ours))[1])
    args = SimpleNamespace(dtype="float32", context=4, new_tokens=5, repeats=3)
    llm = SimpleNamespace(cfg=SimpleNamespace(vocab_size=50))
    (row,) = bench._vs_hf(args, "DIR", llm, {"decode": [{"batch": 2}]}, np.random.default_rng(0), 3)
    assert row["hf_step_s"] == pytest.approx(0.2)
    assert row["hf_tokens_per_s"] == pytest.approx(2 / 0.2)
    assert row["ours_step_s"] == 0.03 and row["ours_tokens_per_s"] == pytest.approx(1.5 / 0.03)
    assert row["ratio"] == pytest.approx((1.5 / 0.03) / (2 / 0.2))
    hf_total = 1.0 + 4 * 0.2 + 0.05  # the median repeat's whole call
    assert row["hf_total_s"] == pytest.approx(hf_total) and row["ours_total_s"] == 0.6
    assert row["total_ratio"] == pytest.approx(hf_total / 0.6)
    assert len(seen) == 4 and all(ids == seen[0] for ids in seen)  # warm-up included
    assert mine == [seen[0]] * 3 and np.shape(seen[0]) == (2, 4)  # the same prompts on both sides


def test_profile_summary_on_a_made_up_trace(tmp_path):
    """The profile table from a hand-made trace: the newest trace file is read; per program its runs
    (by run_id), wall time per run (first op's start to last op's end, each run), summed op time per
    run, and each op kind's share of it and calls per run, largest first; non-op events ignored."""

    def write(path, events, mtime):
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": events}, f)
        os.utime(path, (mtime, mtime))

    def op(module, name, ts, dur, run):
        return {"ph": "X", "ts": ts, "dur": dur, "args": {"hlo_module": module, "hlo_op": name, "run_id": run}}

    events = [
        # decode, run 1: 100..400 us; run 2: 1000..1500 us (ops overlap: 400 us of ops in 500 us)
        op("jit_decode", "dot.1", 100, 200, 1),
        op("jit_decode", "fusion.3", 300, 100, 1),
        op("jit_decode", "dot.2", 1000, 300, 2),
        op("jit_decode", "dot.2", 1200, 300, 2),
        op("jit_decode", "fusion.4", 1400, 100, 2),
        op("jit_forward", "dot.7", 5000, 50, 9),
        {"ph": "X", "ts": 0, "dur": 10**6, "args": {"name": "not an op"}},
        {"ph": "B", "ts": 0, "args": {"hlo_module": "jit_decode", "hlo_op": "dot.9"}},
    ]
    write(tmp_path / "a" / "old.trace.json.gz", [op("jit_stale", "dot.1", 0, 9, 1)], 1_000_000)
    write(tmp_path / "b" / "new.trace.json.gz", events, 2_000_000)
    decode, forward = bench.profile_summary(str(tmp_path))
    assert decode["program"] == "jit_decode" and forward["program"] == "jit_forward"
    assert decode["runs"] == 2 and forward["runs"] == 1
    assert decode["wall_ms"] == pytest.approx((300 + 500) / 2 / 1e3)
    assert decode["op_ms"] == pytest.approx((200 + 100 + 300 + 300 + 100) / 2 / 1e3)
    assert decode["ops"] == [
        {"kind": "dot", "share": pytest.approx(800 / 1000), "per_run": 1.5},
        {"kind": "fusion", "share": pytest.approx(200 / 1000), "per_run": 1.0},
    ]
    assert forward["wall_ms"] == forward["op_ms"] == pytest.approx(0.05)


def test_drive_engine_gaps_on_a_made_up_clock(monkeypatch):
    """The throughput bench's ITL samples: each token after a sequence's first gives the time since
    that sequence's previous token (steps without a token for it in between included); the wall runs
    from the first request added to the last step."""
    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    a, b = SimpleNamespace(seq_id="a"), SimpleNamespace(seq_id="b")
    # Steps end at t = 1, 3, 4, 8, 9; a has tokens at 1, 3, 8; b at 3, 4, 9.
    steps = [(1.0, [a]), (3.0, [a, b]), (4.0, [b]), (8.0, [a]), (9.0, [b])]
    released = []

    def step():
        t, seqs = steps.pop(0)
        clock.now = t
        return [SimpleNamespace(seq=s, token_ids=[7]) for s in seqs] + [SimpleNamespace(seq=a, token_ids=[])]

    engine = SimpleNamespace(
        add_request=lambda p, sp: SimpleNamespace(request_id=p[0], seqs=[p[0]]),
        has_unfinished=lambda: bool(steps),
        step=step,
        release=released.append,
    )
    wall, seqs, gaps = bench.drive_engine(engine, [["r1"], ["r2"]], [None, None])
    assert wall == 9.0 and seqs == ["r1", "r2"] and released == ["r1", "r2"]
    assert sorted(gaps) == sorted([3 - 1, 8 - 3, 4 - 3, 9 - 4])


def _throughput_fakes(monkeypatch, walls):
    """A stand-in LLM whose engine counts phase totals, and a drive_engine that takes `walls` in turn:
    every request makes 4 tokens, one 8-token prompt call and 3 decode rows; of each run's wall,
    half is prompt calls and a quarter decode calls."""
    totals = {"prefill": [0.0, 0, 0], "decode": [0.0, 0, 0]}
    engine = SimpleNamespace(
        warmup=lambda: 0,
        wait_for_huge_pages=lambda: None,
        async_scheduling=True,
        stats=lambda: {
            "step_seconds": {ph: {"sum": t[0], "count": t[1]} for ph, t in totals.items()},
            "step_tokens": {ph: t[2] for ph, t in totals.items()},
        },
    )
    stats = {"kv_pages_total": 1, "kv_cache_bytes": 1, "num_preemptions": 0, "prefix_cache_hit_tokens": 0}

    class LLM:
        def __init__(self, model, **kw):
            self.cfg = SimpleNamespace(name="fake", num_params=1, dtype="float32", vocab_size=50)
            self.engine = engine

        def stats(self):
            return stats

    walls, seen = iter(walls), []

    def drive_engine(eng, prompts, params):
        assert eng is engine
        seen.append((len(prompts), eng.async_scheduling))
        wall = next(walls)
        n = len(prompts)
        for ph, (s, calls, tokens) in (("prefill", (wall / 2, n, 8 * n)), ("decode", (wall / 4, 3, 3 * n))):
            totals[ph] = [totals[ph][0] + s, totals[ph][1] + calls, totals[ph][2] + tokens]
        times = dict(arrival_time=0.0, first_token_time=wall, last_token_time=wall)
        seqs = [SimpleNamespace(output_ids=[i] * sp.max_tokens, **times) for i, sp in enumerate(params)]
        return wall, seqs, [wall / 10] * n

    monkeypatch.setattr(bench, "drive_engine", drive_engine)
    return LLM, seen


def test_throughput_rounds_pool_each_side_on_made_up_runs(monkeypatch, capsys):
    """Two rounds of 3 baseline requests (1 s each in round 1, 2 s in round 2) against 6 requests at
    once (2 s, then 3 s), 4 tokens each; then the sync run (4 s). Each round's ratio is that round's
    rates; the headline ratio pools each side's tokens over its summed wall (3.6x: neither the median
    nor the mean of the rounds' 3x and 4x); --vs-sync's is the sync run's wall over the last round's."""
    LLM, seen = _throughput_fakes(monkeypatch, [1.0] * 3 + [2.0] + [2.0] * 3 + [3.0] + [4.0])
    argv = ["throughput", "--num-requests", "6", "--baseline-requests", "3", "--rounds", "2", "--vs-sync"]
    args = _bench_args(argv + ["--prompt-len-range", "8", "--output-len-range", "4"])
    report = bench._throughput(args, None, LLM)
    assert seen == [(1, True)] * 3 + [(6, True)] + [(1, True)] * 3 + [(6, True), (6, False)]
    assert report["round_ratios"] == pytest.approx([(24 / 2) / (12 / 3), (24 / 3) / (12 / 6)])
    base, cb, sync = report["one_at_a_time"], report["continuous"], report["continuous_sync"]
    assert (base["wall_s"], cb["wall_s"], sync["wall_s"]) == (9.0, 5.0, 4.0)
    assert base["output_tokens_per_s"] == pytest.approx(24 / 9) and cb["output_tokens_per_s"] == pytest.approx(48 / 5)
    assert report["ratio"] == pytest.approx((48 / 5) / (24 / 9))
    rates = (base["requests_per_s"], cb["requests_per_s"], sync["requests_per_s"])
    assert rates == pytest.approx((6 / 9, 12 / 5, 6 / 4))
    assert sync["output_tokens_per_s"] == pytest.approx(24 / 4)
    # Where the time went: the rounds' phase totals pooled per side; the sync run's alone.
    assert (base["prefill_s"], base["decode_s"], base["other_s"]) == pytest.approx((4.5, 2.25, 2.25))
    assert (base["prefill_tokens"], base["decode_calls"], base["decode_rows"]) == (48, 18, 18)
    assert (cb["prefill_s"], cb["prefill_calls"], cb["decode_calls"], cb["decode_rows"]) == (2.5, 12, 6, 36)
    assert (sync["prefill_s"], sync["decode_s"], sync["other_s"]) == (2.0, 1.0, 1.0)
    # Latencies pooled over the rounds: every gap of a side's runs.
    assert base["itl_p50_s"] == pytest.approx(np.percentile([0.1] * 3 + [0.2] * 3, 50))
    assert cb["ttft_p99_s"] == pytest.approx(np.percentile([2.0] * 6 + [3.0] * 6, 99))
    out = capsys.readouterr().out
    assert "continuous batching / one at a time: 3.60x output-token throughput" in out
    assert "each round 3.00x, 4.00x" in out
    assert "async scheduling / one step at a time: 1.33x (same outputs)" in out  # 4 s / 3 s


def test_serve_summary_counts_ttft_from_arrival_and_only_finished_tokens():
    """The serve bench's summary: TTFT from the workload's arrival (a wait for a slot included, not
    from the send), p50 and p99 as NumPy's percentiles of those; tokens of requests that failed are
    not counted as output."""
    from serving import loadgen
    from serving.loadgen import Outcome

    outcomes = [
        Outcome(sent=2.0, arrival=0.0, first=2.5, done=4.5, tokens=[5] * 5),  # waited 2 s for a slot
        Outcome(sent=0.0, arrival=0.0, first=1.0, done=2.0, tokens=[5] * 3),
        Outcome(sent=0.0, arrival=0.5, first=0.75, done=1.75, tokens=[5] * 2),
        Outcome(sent=0.0, arrival=0.0, first=1.0, tokens=[5] * 4, code="CANCELLED (duration limit)"),
    ]
    got = loadgen.summarize(outcomes, wall=5.0)
    ttft = [2.5, 1.0, 0.25]
    assert (got["ttft_p50_s"], got["ttft_p99_s"]) == (np.percentile(ttft, 50), np.percentile(ttft, 99))
    tpot = [2.0 / 4, 1.0 / 2, 1.0 / 1]
    assert (got["tpot_p50_s"], got["tpot_p99_s"]) == (np.percentile(tpot, 50), np.percentile(tpot, 99))
    assert (got["output_tokens"], got["output_tokens_per_s"]) == (10, 2.0)
    assert got["errors"] == {"CANCELLED (duration limit)": 1}


def test_serve_rounds_count_the_warmup_rounds_outputs_and_errors(monkeypatch):
    """`_compare`: the warm-up round's throughput stays out of the median, but what it says about
    correctness does not: an output that differs from offline there, or an error, is reported. The
    offline side's rate is its output tokens over its wall."""
    from serving import loadgen
    from serving.loadgen import Outcome

    served_rates = iter([10.0, 30.0, 20.0])  # warm-up, round 1, round 2
    round_no = iter(range(3))

    def serve_round(prompts, params, arrivals):
        r = next(round_no)
        errors = {"UNAVAILABLE": 1} if r == 0 else {}
        return [Outcome(sent=0.0, tokens=[2 if r == 0 and i == 1 else 1] * 4) for i in range(len(prompts))], {
            "output_tokens_per_s": next(served_rates),
            "errors": errors,
        }

    walls = iter([2.0, 4.0, 5.0])

    def drive_engine(engine, prompts, params):
        seqs = [
            SimpleNamespace(output_ids=[1] * 4, arrival_time=0.0, first_token_time=1.0, last_token_time=2.0)
            for _ in prompts
        ]
        return next(walls), seqs, [0.5] * len(prompts)

    monkeypatch.setattr(loadgen, "drive_engine", drive_engine)
    args = argparse.Namespace(
        prompt_len_range=[4, 8], output_len_range=[2, 4], num_requests=3, request_rate=float("inf"), repeats=2
    )
    args.vs_offline = True
    report, rows = loadgen._compare(args, 100, serve_round, llm=SimpleNamespace(engine=None))
    offline = [12 / 2.0, 12 / 4.0, 12 / 5.0]  # 3 requests x 4 tokens over each round's wall
    assert [x["offline"]["output_tokens_per_s"] for x in report["rounds"]] == offline[1:]
    assert report["warmup_ratio"] == 10.0 / offline[0]
    assert report["ratio"] == pytest.approx(np.median([30.0 / offline[1], 20.0 / offline[2]]))
    assert report["identical_outputs"] == 2  # one differed in the warm-up round
    assert report["errors"] == {"UNAVAILABLE": 1}
