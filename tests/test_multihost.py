"""Multi-host serving for real: two `jaxinfer serve` processes joined by `jax.distributed` on 127.0.0.1
(4 CPU devices each, gloo collectives), one 8-device mesh across both.

The leader (process 0) runs the scheduler and the gRPC server and broadcasts every step; the
follower replays them. Checked: greedy outputs served through the leader equal a single-process
LLM's, for concurrent unary and streaming calls; a follower killed mid-stream makes the in-flight
request fail with UNAVAILABLE within a bound, later requests too, health says NOT_SERVING, and the
leader exits (code 1) promptly on SIGTERM instead of hanging on the dead peer; a follower killed
while loading makes the leader exit (code 1) at once; a follower that hangs
without dying (SIGSTOP) is caught by --peer-timeout the same way, even with no traffic (the idle
leader's heartbeat blocks), and once resumed with its leader gone, it stops by itself; a hung leader
is caught by its followers (its heartbeats stop); a process hung while loading stops the others
after --peer-startup-timeout.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.client import Client, ServerError

# Small capacity: fewer step shapes, so each process compiles little during warm-up.
ENGINE = ["--max-model-len", "64", "--page-size", "8", "--max-num-seqs", "4"]
ENGINE += ["--max-num-batched-tokens", "32", "--no-prefix-caching"]
PROMPTS = [[1, 5, 9, 33], [1, 7, 7, 7, 8, 90, 100, 3, 4], [1, 60], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT_LOGPROBS = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
READY_TIMEOUT = 300  # two processes importing JAX and compiling every step shape on a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Leader + follower subprocesses; logs to files under tmp_path; always killed at the end."""

    def __init__(
        self,
        tmp_path,
        model: str,
        mesh: str,
        *extra: str,
        leader_extra=(),
        follower_extra=(),
        wait: bool = True,
        devices=(4, 4),
    ):
        env = dict(os.environ)
        # 4 devices per process (`devices`), and the compile flags conftest sets for the tests' own processes.
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env.update(JAX_PLATFORMS="cpu")
        coordinator = f"127.0.0.1:{_free_port()}"
        common = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", model, "--mesh", mesh, *ENGINE, *extra]
        common += ["--coordinator-address", coordinator, "--num-processes", "2"]
        self.logs = {}
        self.procs = {}
        for role, pid in (("leader", 0), ("follower", 1)):
            out = open(tmp_path / f"{role}.out", "w+")
            err = open(tmp_path / f"{role}.err", "w+")
            self.logs[role] = (out, err)
            own = ["--port", "0", *leader_extra] if pid == 0 else list(follower_extra)
            xla = " ".join([f"--xla_force_host_platform_device_count={devices[pid]}", *flags])
            self.procs[role] = subprocess.Popen(
                [*common, "--process-id", str(pid), *own],
                stdout=out,
                stderr=err,
                env=env | {"XLA_FLAGS": xla},
                cwd=tmp_path,
            )
        if not wait:
            return
        try:
            self.port = self._wait_for(r"listening on 127\.0\.0\.1:(\d+)", 120)
            self._wait_for(r"ready \(", READY_TIMEOUT)
        except BaseException:
            self.close()  # a job that never came up leaves no process behind
            raise
        self.address = f"127.0.0.1:{self.port}"

    def log(self, role: str, stream: int = 1) -> str:
        f = self.logs[role][stream]
        f.flush()
        with open(f.name) as g:
            return g.read()

    def _wait_for(self, pattern: str, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log("leader", 0))
            if m:
                return int(m.group(1)) if m.groups() else 0
            for role, p in self.procs.items():
                if p.poll() is not None:
                    raise AssertionError(f"{role} exited with {p.returncode}:\n{self.log(role)[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} from the leader in {timeout} s:\n{self.log('leader')[-3000:]}")

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for out, err in self.logs.values():
            out.close()
            err.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random-weight Gemma 2 written by transformers: 8 query heads, 2 KV heads (fewer than model=8,
    so the KV cache is replicated across both processes' devices while the heads split). Its
    sliding-window layer gets pools and a page table of its own (4 sequences x 6 pages < 48), so
    every step broadcasts both tables."""
    from hf_models import make_hf_gemma, save_hf_model

    path = tmp_path_factory.mktemp("mh-model")
    save_hf_model(make_hf_gemma("gemma2", num_attention_heads=8, num_key_value_heads=2), path)
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, max_model_len=64, page_size=8, num_kv_pages=48, max_num_seqs=4, max_num_batched_tokens=32)
    assert llm.stats()["kv_window_pages_total"] == 4 * 6
    out = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    assert len({tuple(o) for o in out}) == len(out)  # varied, so agreement means something
    return out


@pytest.fixture(scope="module")
def reference_prompt_logprobs(model_dir):
    llm = LLM(model_dir, max_model_len=64, page_size=8, num_kv_pages=48, max_num_seqs=4, max_num_batched_tokens=32)
    return llm.generate(prompt_token_ids=[PROMPTS[3]], sampling_params=PROMPT_LOGPROBS)[0].prompt_logprobs


def _leader_compilations(metrics_port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return float(re.search(r"^jaxinfer_xla_compilations (\S+)$", body, re.M).group(1))


def _stream_until_error(client: Client, after_tokens: int, act) -> tuple[int, float, ServerError | None]:
    """Streams a long request; after `after_tokens` deltas calls act(); returns (deltas seen, seconds
    from act() to the error, the error)."""
    seen, t_act = 0, None
    try:
        for _ in client.stream(
            prompt_token_ids=[1, 5, 9], sampling_params=SamplingParams(max_tokens=50, temperature=0)
        ):
            seen += 1
            if seen == after_tokens:
                act()
                t_act = time.monotonic()
    except ServerError as e:
        return seen, time.monotonic() - t_act, e
    return seen, float("nan"), None


def test_two_processes_serve_like_one_and_a_dead_follower_fails_fast(
    tmp_path, model_dir, reference, reference_prompt_logprobs
):
    job = Job(tmp_path, model_dir, "data=1,model=8", "--num-kv-pages", "48", leader_extra=["--metrics-port", "0"])
    try:
        metrics_port = int(re.search(r"metrics on 127\.0\.0\.1:(\d+)", job.log("leader", 0)).group(1))
        compiled_in_warmup = _leader_compilations(metrics_port)
        client = Client(job.address)
        info = client.model_info()
        assert info["mesh"] == "data=1,model=8 over 8 cpu devices"
        assert (info["kv_pages_total"], info["kv_window_pages_total"]) == (47, 4 * 6)  # Gemma 2: two pool sizes
        # Concurrent unary and streaming requests through the leader == one process, token for token.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            unary = [pool.submit(client.generate, prompt_token_ids=p, sampling_params=GREEDY) for p in PROMPTS]
            streams = [
                pool.submit(
                    lambda p: [
                        t for d in client.stream(prompt_token_ids=p, sampling_params=GREEDY) for t in d.token_ids
                    ],
                    p,
                )
                for p in PROMPTS
            ]
            assert [f.result(timeout=120).token_ids for f in unary] == reference
            assert [f.result(timeout=120) for f in streams] == reference
        assert "follower 1 of 2 ready" in job.log("follower")
        # A prompt-logprobs step: its own program (compiled in every process's warm-up) and inputs
        # (the targets, broadcast with the batch).
        got = client.generate(prompt_token_ids=PROMPTS[3], sampling_params=PROMPT_LOGPROBS).prompt_logprobs
        ref = reference_prompt_logprobs
        assert got[0] is None and [x.token_id for x in got[1:]] == [x.token_id for x in ref[1:]] == PROMPTS[3][1:]
        np.testing.assert_allclose([x.logprob for x in got[1:]], [x.logprob for x in ref[1:]], atol=1e-4)
        for a, b in zip(got[1:], ref[1:]):
            np.testing.assert_allclose(list(a.top.values()), list(b.top.values()), atol=1e-4)
        # Nothing compiled in service on the leader: a compile there stalls every process's next
        # collective (the sampler too: warmed on the very device it samples on).
        assert _leader_compilations(metrics_port) == compiled_in_warmup

        # Kill the follower mid-stream: the leader's next collective fails; the request ends UNAVAILABLE.
        seen, waited, err = _stream_until_error(client, 3, lambda: job.procs["follower"].send_signal(signal.SIGKILL))
        assert err is not None and err.code == "UNAVAILABLE", (seen, err)
        assert "multi-host job is broken" in str(err)
        assert 3 <= seen < 50 and waited < 15, (seen, waited)
        with pytest.raises(ServerError) as later:
            client.generate(prompt_token_ids=[1, 2], sampling_params=GREEDY)
        assert later.value.code == "UNAVAILABLE"
        assert client.health() == "NOT_SERVING"
        # SIGTERM: out promptly with status 1, not blocked on the dead peer nor aborted by JAX.
        t = time.monotonic()
        job.procs["leader"].send_signal(signal.SIGTERM)
        assert job.procs["leader"].wait(timeout=30) == 1
        assert time.monotonic() - t < 20
        assert "multi-host job was broken" in job.log("leader", 0)
        assert "Check failure" not in job.log("leader")
    finally:
        job.close()


def _wait_until(check, timeout: float, what: str) -> float:
    """Polls check() until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout} s"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_a_hung_follower_is_caught_by_the_peer_timeout_with_no_traffic(tmp_path):
    """SIGSTOP: the follower's sockets stay open, so no collective fails; only the watchdog can tell.
    The job is idle: the leader's heartbeat is the collective that blocks, so health turns
    NOT_SERVING without any request having to wait first. (No --num-kv-pages: each process sizes
    the cache from its own free memory, and all take the leader's count.)"""
    job = Job(tmp_path, "embedded:tiny-random", "data=2,model=4", "--peer-timeout", "4")
    try:
        client = Client(job.address)
        out = client.generate(prompt_token_ids=[1, 5, 9], sampling_params=GREEDY)
        assert len(out.token_ids) == 10
        time.sleep(2.5)  # idle, past a heartbeat interval (1 s): the job stays healthy
        assert client.health() == "SERVING"
        job.procs["follower"].send_signal(signal.SIGSTOP)
        waited = _wait_until(lambda: client.health() == "NOT_SERVING", 20, "NOT_SERVING")
        assert 3 <= waited < 12, waited
        with pytest.raises(ServerError) as later:
            client.generate(prompt_token_ids=[1, 2], sampling_params=GREEDY)
        assert later.value.code == "UNAVAILABLE" and "waited 4 s for the other processes" in str(later.value)
        job.procs["leader"].send_signal(signal.SIGTERM)
        assert job.procs["leader"].wait(timeout=30) == 1
        # Resumed, the follower finds the leader (and the coordination service it hosted) gone and stops
        # by itself: through our path (its watchdog, or its collective failing: it logs why and exits 1)
        # or, when JAX's error poll sees the dead coordinator first, by JAX's runtime (SIGABRT).
        job.procs["follower"].send_signal(signal.SIGCONT)
        code = job.procs["follower"].wait(timeout=60)
        log = job.log("follower")
        assert (code == 1 and "follower 1: " in log) or (code == -signal.SIGABRT and "Terminating process" in log), (
            code,
            log[-2000:],
        )
    finally:
        job.procs["follower"].send_signal(signal.SIGCONT)
        job.close()


def test_sigterm_stops_a_healthy_job_cleanly(tmp_path):
    """The leader drains, tells the followers to stop (after idle heartbeats), and both exit 0. (The
    follower spells the mesh another way: the same mesh, which the settings check once refused.)"""
    job = Job(
        tmp_path,
        "embedded:tiny-random",
        "data=2,model=4",
        "--peer-timeout",
        "4",
        follower_extra=["--mesh", "model=4,data=2"],
    )
    try:
        client = Client(job.address)
        stream = client.stream(prompt_token_ids=[1, 5, 9], sampling_params=GREEDY)
        first = next(stream)
        job.procs["leader"].send_signal(signal.SIGTERM)
        assert len(first.token_ids) + sum(len(d.token_ids) for d in stream) == 10  # in flight: finished
        assert job.procs["leader"].wait(timeout=60) == 0
        assert job.procs["follower"].wait(timeout=60) == 0
        assert "the leader stopped; exiting" in job.log("follower")
    finally:
        job.close()


def test_a_follower_that_died_while_the_job_idled_makes_sigterm_exit_1(tmp_path):
    """Killed between two heartbeats (the default --peer-timeout: every 10 s), the follower's death
    is found by the leader's broadcast of the stop on SIGTERM. That failure was only logged, with a
    traceback, and the leader exited 0, which tells a supervisor the job ended well."""
    job = Job(tmp_path, "embedded:tiny-random", "data=2,model=4")
    try:
        client = Client(job.address)
        assert len(client.generate(prompt_token_ids=[1, 5, 9], sampling_params=GREEDY).token_ids) == 10
        job.procs["follower"].kill()
        job.procs["follower"].wait(timeout=30)
        job.procs["leader"].send_signal(signal.SIGTERM)
        assert job.procs["leader"].wait(timeout=60) == 1, job.log("leader")[-2000:]
        out, err = job.log("leader", 0), job.log("leader")
        assert "the multi-host job was broken" in out and "Traceback" not in out + err, (out + err)[-2000:]
    finally:
        job.close()


def test_sigterm_to_a_follower_ends_it_and_the_leader_finds_it_gone(tmp_path):
    """A follower sits in collectives, where no Python handler runs, and JAX's runtime takes SIGTERM
    with a C handler of its own that only notes it: a follower told to stop went on serving until
    the leader stopped it (a supervisor's stop did nothing until its SIGKILL). It now exits at once,
    and the leader fails the next request as for any follower that dies."""
    job = Job(tmp_path, "embedded:tiny-random", "data=2,model=4", "--peer-timeout", "4")
    try:
        client = Client(job.address)
        assert len(client.generate(prompt_token_ids=[1, 5, 9], sampling_params=GREEDY).token_ids) == 10
        job.procs["follower"].send_signal(signal.SIGTERM)
        assert job.procs["follower"].wait(timeout=30) == 128 + signal.SIGTERM, job.log("follower")[-2000:]
        assert "SIGTERM; exiting" in job.log("follower")
        with pytest.raises(ServerError) as e:
            client.generate(prompt_token_ids=[1, 5, 9], sampling_params=GREEDY, timeout=60)
        assert e.value.code == "UNAVAILABLE", e.value
        job.procs["leader"].send_signal(signal.SIGTERM)
        assert job.procs["leader"].wait(timeout=60) == 1, job.log("leader")[-2000:]
    finally:
        job.close()


def test_processes_with_different_device_counts_are_refused_by_name(tmp_path):
    """A mesh over 4 + 2 devices: the settings check's collective assumes equal counts and failed
    with NumPy's "cannot reshape array of size 6 into shape (2,4)" (on the follower as an
    "unexpected" error). Both processes now say what differs."""
    job = Job(tmp_path, "embedded:tiny-random", "data=2,model=3", wait=False, devices=(4, 2))
    try:
        codes = {role: p.wait(timeout=READY_TIMEOUT) for role, p in job.procs.items()}
        assert codes == {"leader": 2, "follower": 2}, (codes, job.log("leader")[-2000:], job.log("follower")[-2000:])
        for role in codes:
            log = job.log(role)
            assert "different numbers of devices (process 0: 4, process 1: 2)" in log, log[-2000:]
            assert "unexpected" not in log and "reshape" not in log
    finally:
        job.close()


def test_a_hung_leader_is_caught_by_its_followers(tmp_path):
    """SIGSTOP the idle leader: its heartbeats stop, so the follower exits (status 1) once it has heard
    nothing for --peer-timeout, instead of waiting forever. Resumed, the leader's next heartbeat
    fails on the gone follower: health NOT_SERVING, requests UNAVAILABLE, exit 1 on SIGTERM."""
    job = Job(
        tmp_path,
        "embedded:tiny-random",
        "data=2,model=4",
        "--peer-timeout",
        "4",
        follower_extra=["--peer-timeout", "60"],  # its own value does not count: the leader's 4 does
    )
    try:
        client = Client(job.address)
        assert len(client.generate(prompt_token_ids=[1, 5, 9], sampling_params=GREEDY).token_ids) == 10
        time.sleep(2.5)
        assert job.procs["follower"].poll() is None  # an idle leader's heartbeats keep it
        job.procs["leader"].send_signal(signal.SIGSTOP)
        t = time.monotonic()
        assert job.procs["follower"].wait(timeout=30) == 1
        assert 2 <= time.monotonic() - t < 15  # its wait may have begun up to a heartbeat before the stop
        assert "the leader has sent nothing for 4 s" in job.log("follower")
        job.procs["leader"].send_signal(signal.SIGCONT)
        _wait_until(lambda: client.health() == "NOT_SERVING", 20, "NOT_SERVING")
        with pytest.raises(ServerError) as later:
            client.generate(prompt_token_ids=[1, 2], sampling_params=GREEDY)
        assert later.value.code == "UNAVAILABLE" and "heartbeat" in str(later.value)
        job.procs["leader"].send_signal(signal.SIGTERM)
        assert job.procs["leader"].wait(timeout=30) == 1
    finally:
        job.procs["leader"].send_signal(signal.SIGCONT)
        job.close()


@pytest.mark.parametrize("hung", ["follower", "leader"])
def test_a_process_hung_while_loading_stops_the_others(tmp_path, hung):
    """One process stops (SIGSTOP) as soon as both have joined the job: the other waits in the
    first collective of its loading (the settings check) and exits with status 1 once it has waited
    --peer-startup-timeout, saying why, instead of loading forever."""
    # The bound covers the join too, hence room for the two processes' start-ups to differ.
    job = Job(tmp_path, "embedded:tiny-random", "data=2,model=4", "--peer-startup-timeout", "10", wait=False)
    other = "leader" if hung == "follower" else "follower"
    try:
        job._wait_for(r"listening on 127\.0\.0\.1:(\d+)", 120)  # both processes have joined
        job.procs[hung].send_signal(signal.SIGSTOP)
        t = time.monotonic()
        assert job.procs[other].wait(timeout=60) == 1, job.log(other)[-2000:]
        assert 8 <= time.monotonic() - t < 40
        assert "waited 10 s for the other processes" in job.log(other)
    finally:
        job.procs[hung].send_signal(signal.SIGCONT)
        job.close()


def test_a_follower_killed_while_loading_fails_the_leader_at_once(tmp_path):
    """SIGKILL: the follower's sockets close, so the leader's next collective while loading fails at
    once (gloo: connection closed, or connect timeout). The leader exits with status 1 - the job
    broke, not the model (status 2 before, with gloo's bare message) - saying so, long before its
    --peer-startup-timeout (600 s by default)."""
    job = Job(tmp_path, "embedded:tiny-random", "data=2,model=4", wait=False)
    try:
        job._wait_for(r"listening on 127\.0\.0\.1:(\d+)", 120)  # both processes have joined
        job.procs["follower"].send_signal(signal.SIGKILL)
        t = time.monotonic()
        assert job.procs["leader"].wait(timeout=90) == 1, job.log("leader")[-2000:]
        assert time.monotonic() - t < 60
        assert "while loading, a collective with the other processes failed (did a follower exit?)" in job.log("leader")
    finally:
        job.close()


def test_a_jaxinfer_checkpoint_with_a_nan_is_refused_by_every_process(tmp_path):
    """The restored weights' count of non-finite values runs as one program in every process; a
    tensor split over both processes (model=8 across their 4 + 4 devices) is counted by a collective,
    so both see the count and both exit 2 naming the tensor. (Where each process holds a whole copy,
    data=2, each counts its own, and the slower one may instead find the other gone: exit 1.)"""
    import numpy as np

    from jaxinfer import checkpoint
    from jaxinfer.default_model import ASSETS

    cfg, params = checkpoint.restore(ASSETS)
    params = jax.tree.map(np.array, params)
    params["layer_1"]["mlp"]["w_down"].reshape(-1)[7] = np.nan
    checkpoint.save(tmp_path / "ckpt", cfg, params, tokenizer_dir=ASSETS)
    job = Job(tmp_path, str(tmp_path / "ckpt"), "data=1,model=8", wait=False)
    try:
        codes = {role: p.wait(timeout=120) for role, p in job.procs.items()}
        assert codes == {"leader": 2, "follower": 2}, {r: job.log(r)[-2000:] for r in job.procs}
        for role in job.procs:
            assert "tensor 'layer_1/mlp/w_down' holds 1 NaN or infinite value" in job.log(role), job.log(role)[-2000:]
    finally:
        job.close()


def test_processes_started_with_different_settings_are_refused_by_name(tmp_path, model_dir):
    """A follower with another page count would run every step on a cache of another size (the
    collectives only need equal shapes) and return wrong tokens; both processes now refuse to start,
    naming the setting."""
    job = Job(
        tmp_path,
        model_dir,
        "data=1,model=8",
        "--num-kv-pages",
        "48",
        follower_extra=["--num-kv-pages", "40"],
        wait=False,
    )
    try:
        codes = {role: p.wait(timeout=READY_TIMEOUT) for role, p in job.procs.items()}
        assert codes == {"leader": 2, "follower": 2}, (codes, job.log("leader")[-2000:], job.log("follower")[-2000:])
        for role, value in (("leader", 48), ("follower", 40)):
            log = job.log(role)
            assert "num_kv_pages (processes [1] differ from process 0" in log, log[-2000:]
            assert f"here, on process {int(role == 'follower')}: {value})" in log
            assert "max_num_seqs" not in log  # only what differs
    finally:
        job.close()


def test_a_leader_that_cannot_start_lets_its_follower_say_so(tmp_path):
    """The leader's --port taken: it exits 2 naming the port; the follower, whose collective then
    fails, says it lost the other processes (it said "unexpected JaxRuntimeError: ... Gloo ...")."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        job = Job(tmp_path, "embedded:tiny-random", "data=2,model=4", leader_extra=["--port", str(port)], wait=False)
        try:
            codes = {role: p.wait(timeout=READY_TIMEOUT) for role, p in job.procs.items()}
            assert codes == {"leader": 2, "follower": 1}, (
                codes,
                job.log("leader")[-2000:],
                job.log("follower")[-2000:],
            )
            assert f"127.0.0.1:{port}" in job.log("leader")
            follower = job.log("follower")
            assert "lost the other processes (did the leader exit?)" in follower, follower[-2000:]
            assert "unexpected" not in follower
        finally:
            job.close()


def test_a_kv_cache_no_device_holds_is_refused_by_every_process(tmp_path, model_dir):
    """What must fit (on CPU: this process's devices' shares together) is checked against the least
    free memory of all processes, so every process refuses alike (one refusing alone would leave the
    other waiting for it)."""
    job = Job(tmp_path, model_dir, "data=1,model=8", "--num-kv-pages", str(2**30), wait=False)
    try:
        codes = {role: p.wait(timeout=READY_TIMEOUT) for role, p in job.procs.items()}
        assert codes == {"leader": 2, "follower": 2}, (codes, job.log("leader")[-2000:], job.log("follower")[-2000:])
        for role in codes:
            log = job.log(role)
            assert "GiB on this process's CPU devices (4, sharing the host's memory), more than the" in log
            assert "free on the device of the process with the least" in log
    finally:
        job.close()


def test_a_follower_told_another_process_count_is_refused_by_name(tmp_path):
    """The coordinator's count wins: a follower told --num-processes 3 joined a job of 2 and served
    without a word. It now says so and exits 2 (what the leader then does is the lost-follower case)."""
    job = Job(tmp_path, "embedded:tiny-random", "data=2,model=4", follower_extra=["--num-processes", "3"], wait=False)
    try:
        assert job.procs["follower"].wait(timeout=120) == 2, job.log("follower")[-2000:]
        log = job.log("follower")
        assert re.search(
            r"error: --num-processes 3 differs from the job's: the coordinator at 127\.0\.0\.1:\d+ counts 2", log
        )
        assert "Traceback" not in log
    finally:
        job.close()


def test_a_job_that_does_not_form_is_refused_by_name_within_the_startup_timeout(tmp_path):
    """Joining is bounded by --peer-startup-timeout, and a job that does not form ends each process
    with status 2 and a line saying what is missing. JAX's own join timeout (120 s here before, not
    the flag) aborted the process instead: SIGABRT and a C++ stack trace. Three processes at once:
    a follower whose coordinator is not there, and process 0 and 1 of a job of 3 whose third never
    comes (the follower's bound is the shorter, so it speaks while the coordinator still answers)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    serve = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", "embedded:tiny-random", *ENGINE]
    nobody, job = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    runs = {
        "lone follower": (nobody, "2", "1", "3"),
        "leader of 3": (job, "3", "0", "12"),
        "follower of 3": (job, "3", "1", "3"),
    }
    procs = {}
    for name, (address, count, pid, limit) in runs.items():
        flags = ["--coordinator-address", address, "--num-processes", count, "--process-id", pid]
        err = open(tmp_path / f"{name}.err", "w+")
        procs[name] = (subprocess.Popen([*serve, *flags, "--peer-startup-timeout", limit], stderr=err, env=env), err)
    try:
        for name, (p, _) in procs.items():
            assert p.wait(timeout=120) == 2, (name, p.returncode)
        logs = {name: open(err.name).read() for name, (_, err) in procs.items()}
    finally:
        for p, err in procs.values():
            p.kill()
            err.close()
    assert re.search(
        rf"error: process 1 of 2 waited 3 s to join the multi-host job at {nobody}: nothing answers there "
        r"\(Connection refused\): is process 0 started",
        logs["lone follower"],
    ), logs["lone follower"]
    assert (
        f"error: process 0 of 3 waited 12 s to join the multi-host job at {job}: not all 3 processes joined "
        f"(start each with --coordinator-address {job} --num-processes 3 and its own --process-id)"
    ) in logs["leader of 3"], logs["leader of 3"]
    assert (
        f"error: process 1 of 3 waited 3 s to join the multi-host job at {job}: the coordinator answers, but the "
        "job did not form"
    ) in logs["follower of 3"], logs["follower of 3"]
    for log in logs.values():
        assert "Check failure" not in log and "Traceback" not in log


@pytest.mark.parametrize(
    "address", ["127.0.0.1:abc", "nonsense", "127.0.0.1:70000", "127.0.0.1:65536", "127.0.0.1:0", ":8476", "127.0.0.1:"]
)
def test_bad_coordinator_addresses_are_refused_by_name(address):
    from jaxinfer import distributed

    with pytest.raises(ValueError, match="--coordinator-address must be HOST:PORT with a port in"):
        distributed.initialize(address, 2, 1)


def test_bad_process_counts_and_a_taken_coordinator_port_are_refused():
    from jaxinfer import distributed

    with pytest.raises(ValueError, match="--num-processes must be at least 1, got 0"):
        distributed.initialize("127.0.0.1:8476", 0, 0)
    for process_id in (-1, 2):
        with pytest.raises(ValueError, match=rf"--process-id must be in \[0, 2\), got {process_id}"):
            distributed.initialize("127.0.0.1:8476", 2, process_id)
    with socket.socket() as s:  # another job's coordinator, or a second process 0
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ValueError, match=r"--coordinator-address 127\.0\.0\.1:\d+: process 0 cannot listen"):
            distributed.initialize(f"127.0.0.1:{s.getsockname()[1]}", 2, 0)
    # A port that a crashed leader's connections left in TIME_WAIT is free again: a restarted job
    # reuses its coordinator address (it was refused for ~60 s, though JAX's coordinator binds it).
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's coordinator listens
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the listening side closes first: its end waits in TIME_WAIT
        client.close()
    time.sleep(0.2)  # the FINs exchanged
    with pytest.raises(OSError), socket.socket() as plain:  # what the check's bind met before
        plain.bind(("127.0.0.1", port))
    distributed._check_can_listen("127.0.0.1", port, f"127.0.0.1:{port}")


def test_the_model_fingerprint_reads_the_files_contents(tmp_path):
    """The processes of a job check they load the same model: files of the same names and sizes but
    other bytes (a different fine-tune) must not pass."""
    from jaxinfer.distributed import model_fingerprint

    (tmp_path / "weights.bin").write_bytes(b"a" * 200_000)
    before = model_fingerprint(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"a" * 199_999 + b"b")  # its last byte only
    after_tail = model_fingerprint(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"b" + b"a" * 199_999)  # its first byte only
    assert len({before, after_tail, model_fingerprint(str(tmp_path))}) == 3
    # A file of between one and two 64 KiB reads: its tail past the first read counts too.
    (tmp_path / "weights.bin").write_bytes(b"a" * 100_000)
    before = model_fingerprint(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"a" * 99_999 + b"b")
    assert model_fingerprint(str(tmp_path)) != before


def test_least_is_the_smallest_of_every_process(monkeypatch):
    """What fits in the tightest process fits everywhere (the two-process tests share one host, whose
    processes see about the same free memory: they cannot tell the least from the most)."""
    from jax.experimental import multihost_utils

    from jaxinfer import distributed

    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([[9], [3], [x[0]]]))
    assert distributed.least(5) == 3 and distributed.least(1) == 1


def test_a_loopback_coordinator_listens_on_loopback_only(monkeypatch):
    """Process 0's coordinator (unauthenticated) binds the loopback address it was given, not every
    interface; another address keeps JAX's default (a cluster name may not be this host's own)."""
    from jaxinfer import distributed

    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)  # the test process's runtime stays as it is
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # as a job of 2 would answer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    distributed.initialize(f"127.0.0.1:{port}", 2, 0)
    distributed.initialize(f"127.0.0.1:{port}", 2, 1)
    distributed.initialize(f"{socket.gethostname()}:{port}", 2, 0)
    assert [kw["coordinator_bind_address"] for kw in joined] == [f"127.0.0.1:{port}", None, None]
    assert [(kw["num_processes"], kw["process_id"]) for kw in joined] == [(2, 0), (2, 1), (2, 0)]


# -- The host logic in one process: what the two-process jobs above reach only in their children. --


@pytest.mark.parametrize("address", ["::1", "fe80::1", "::1:8476", "fe80::1:8476", "[::1", "[::1:8476", "[::1]"])
def test_an_ipv6_coordinator_address_without_brackets_is_refused(address):
    """Taken apart at its last colon, "::1" passed as host ":" and port 1; gRPC reads "::1:8476" as
    one address on its default port 443 (process 0's coordinator then failed to bind)."""
    from jaxinfer import distributed

    with pytest.raises(ValueError, match=r"--coordinator-address must be HOST:PORT .*\(an IPv6 host in brackets"):
        distributed._coordinator(address)
    assert distributed._coordinator("[::1]:8476") == ("::1", 8476)
    assert distributed._coordinator("node-0.cluster:8476") == ("node-0.cluster", 8476)


class _Wire:
    """`broadcast_one_to_all` between a leader's StepChannel and a follower's, in one process: the
    leader's calls queue their values; each follower call takes the next one, once its own arrays
    match it in tree, shapes and dtypes (what the real collective needs of every process)."""

    def __init__(self):
        self.queue = []

    def leader(self, x):
        self.queue.append(x)
        return x

    def follower(self, x):
        sent = self.queue.pop(0)
        assert _signature(x) == _signature(sent), (_signature(x), _signature(sent))
        return sent


def _signature(tree):
    return jax.tree.structure(tree), [(np.shape(a), np.asarray(a).dtype) for a in jax.tree.leaves(tree)]


def _channels():
    from jaxinfer.distributed import StepChannel

    wire, leader, follower = _Wire(), StepChannel(), StepChannel()
    leader._broadcast, follower._broadcast = wire.leader, wire.follower
    return wire, leader, follower


def _batches():
    """A one-table step (b=3, t=5, 8 pages a row) and a hybrid model's two-table one with
    prompt-logprobs targets (b=2, t=4, 6 pages): every number distinct, every array random."""
    from jaxinfer.kv_cache import Batch

    rng = np.random.default_rng(0)

    def ints(*shape):
        return rng.integers(0, 1000, shape).astype(np.int32)

    plain = Batch(tokens=ints(3, 5), q_lens=ints(3), kv_lens=ints(3), page_table=ints(3, 8))
    hybrid = Batch(
        tokens=ints(2, 4), q_lens=ints(2), kv_lens=ints(2), page_table=ints(2, 6), window_page_table=ints(2, 6)
    )
    return plain, hybrid, ints(2, 4)


def _assert_same_batch(got, want):
    for field in ("tokens", "q_lens", "kv_lens", "page_table"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    assert (got.window_page_table is None) == (want.window_page_table is None)
    if want.window_page_table is not None:
        np.testing.assert_array_equal(got.window_page_table, want.window_page_table)


def test_a_step_channel_carries_each_message_to_a_follower_as_sent():
    """Every op, its header slots and arrays, and the leader's --peer-timeout (sent in ms) arrive as
    the leader sent them, the follower's arrays matching the leader's as the collective needs."""
    from jaxinfer.distributed import OP_HEARTBEAT, OP_POISON, OP_STEP, OP_STOP, PeerFailureError

    wire, leader, follower = _channels()
    plain, hybrid, targets = _batches()
    leader.peer_timeout = 4.5
    leader.last_sent = 0.0
    leader.send_step(plain, 5)
    assert leader.last_sent > 0  # an idle leader's next heartbeat counts from here
    op, (batch, t, got_targets) = follower.recv()
    assert (op, t, got_targets, follower.leader_peer_timeout) == (OP_STEP, 5, None, 4.5)
    _assert_same_batch(batch, plain)

    leader.send_step(hybrid, 4, targets)
    op, (batch, t, got_targets) = follower.recv()
    assert (op, t) == (OP_STEP, 4)
    _assert_same_batch(batch, hybrid)
    np.testing.assert_array_equal(got_targets, targets)

    leader.send_poison(np.array([3, 9, 12, 40]), 2)
    op, (pages, group) = follower.recv()
    assert op == OP_POISON and pages.tolist() == [3, 9, 12, 40] and group == 2

    leader.peer_timeout = None  # none sent: the follower keeps the last one it had
    leader.send_heartbeat()
    assert follower.recv() == (OP_HEARTBEAT, None) and follower.leader_peer_timeout == 4.5
    for sent, received in ((1e-5, 0.001), (1e9, (2**31 - 1) / 1000)):  # at least 1 ms; at most an int32
        leader.peer_timeout = sent
        leader.send_heartbeat()
        follower.recv()
        assert follower.leader_peer_timeout == received
    leader.send_stop()
    assert follower.recv() == (OP_STOP, None)
    leader._send([99], ())
    with pytest.raises(PeerFailureError, match="unknown step op 99 from the leader"):
        follower.recv()
    assert wire.queue == []


def test_the_warm_up_broadcasts_what_a_step_of_that_shape_sends(monkeypatch):
    """JAX compiles a broadcast per set of shapes: the warm-up's must be the very ones a step sends
    (the header, then the arrays), or each shape compiles again at its first step in service."""
    from jax.experimental import multihost_utils

    from jaxinfer import distributed

    plain, hybrid, targets = _batches()
    warmed = []
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: warmed.append(_signature(x)) or x)
    distributed.warm_step_broadcast(plain, None)
    distributed.warm_step_broadcast(hybrid, targets)
    sent = []
    _, leader, _ = _channels()
    leader._broadcast = lambda x: sent.append(_signature(x)) or x
    leader.peer_timeout = 60.0
    leader.send_step(plain, 5)
    leader.send_step(hybrid, 4, targets)
    assert warmed == sent and len(sent) == 4


class _FakeEngine:
    """What a follower calls: records each step and poison, and whether a wait on the peers was in
    flight (a follower's step is one: the watchdog bounds it)."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def _run_step(self, batch, t, targets=None):
        from jaxinfer.distributed import peer_wait

        if self.fail:
            raise ValueError("bad step")
        self.calls.append(
            ("step", batch.tokens.shape, t, None if targets is None else targets.tolist(), peer_wait.seconds() > 0)
        )
        return self  # jax.block_until_ready calls block_until_ready() on a leaf that is no jax.Array

    def block_until_ready(self):
        self.calls.append("ready")
        return self

    def _run_poison(self, pages, group):
        from jaxinfer.distributed import peer_wait

        self.calls.append(("poison", pages.tolist(), group, peer_wait.seconds() > 0))


def test_a_follower_replays_the_leaders_steps_until_it_says_stop():
    import types

    from jaxinfer.distributed import PeerFailureError, run_follower

    wire, leader, follower = _channels()
    plain, hybrid, targets = _batches()
    leader.peer_timeout = 4.0
    leader.send_heartbeat()
    leader.send_step(hybrid, 4, targets)
    leader.send_poison(np.array([5, 6]), 1)
    leader.send_step(plain, 5)
    leader.send_stop()
    engine = _FakeEngine()
    watchdog = types.SimpleNamespace(limit=600.0, phase="startup")
    assert run_follower(engine, follower, watchdog) == 0
    assert engine.calls == [
        ("step", (2, 4), 4, targets.tolist(), True),
        "ready",  # waited for: the step's time counts in the wait, not the next message's
        ("poison", [5, 6], 1, True),
        ("step", (3, 5), 5, None, True),
        "ready",
    ]
    assert wire.queue == []
    # Its watchdog's bound: from the start-up one to the leader's --peer-timeout.
    assert (watchdog.limit, watchdog.phase) == (4.0, "serving")
    # The leader gone, or a step failing: a PeerFailureError that says which.
    leader.send_step(plain, 5)
    with pytest.raises(PeerFailureError, match="a step across the processes failed: ValueError: bad step"):
        run_follower(_FakeEngine(fail=True), follower)
    follower._broadcast = lambda x: (_ for _ in ()).throw(RuntimeError("gloo: closed"))
    with pytest.raises(PeerFailureError, match="lost the leader: RuntimeError: gloo: closed"):
        run_follower(_FakeEngine(), follower)


def test_peer_wait_times_the_outermost_wait_only():
    from jaxinfer.distributed import peer_wait

    assert peer_wait.seconds() == 0.0
    with peer_wait():
        outer = peer_wait.since
        time.sleep(0.05)
        with peer_wait():
            assert peer_wait.since == outer
        assert peer_wait.since == outer and peer_wait.seconds() >= 0.05
    assert peer_wait.since is None and peer_wait.seconds() == 0.0


def test_the_watchdog_fires_once_on_a_wait_past_its_limit_and_follows_a_new_limit():
    """Not while no wait is in flight; once (it ends the process) for one past the limit; and a limit
    lowered while it sleeps on a long one (a follower's start-up bound, then the leader's
    --peer-timeout) counts within half a second, not after a quarter of the old limit."""
    from jaxinfer.distributed import Watchdog, peer_wait

    fired = []
    Watchdog(0.1, fired.append)
    time.sleep(0.4)
    assert fired == []  # no wait in flight
    with peer_wait():
        time.sleep(0.6)
    assert len(fired) == 1 and fired[0] > 0.1, fired
    lowered = []
    dog = Watchdog(100.0, lowered.append)
    with peer_wait():
        dog.phase, dog.limit = "serving", 0.2
        time.sleep(1.5)
    assert len(lowered) == 1 and lowered[0] > 0.2, lowered


def test_lost_peers_names_only_the_runtimes_word_that_the_others_are_gone():
    from jaxinfer.distributed import lost_peers

    closed = jax.errors.JaxRuntimeError("INTERNAL: Gloo error: Connection closed by peer [127.0.0.1]:4242\nat ...")
    assert lost_peers(closed) == "INTERNAL: Gloo error: Connection closed by peer [127.0.0.1]:4242"
    assert lost_peers(jax.errors.JaxRuntimeError("UNAVAILABLE: the coordination service is gone")).startswith("UNAVAIL")
    assert lost_peers(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: shapes differ\nGloo")) is None  # a bug, not a peer
    assert lost_peers(ConnectionError("Connection refused by Gloo")) is None  # not from the runtime


def _settings(**changes):
    base = {
        "dtype": "bfloat16",
        "mesh": "data=1,model=8",
        "num_kv_pages": 48,
        "page_size": 8,
        "extra": {"a": 1, "b": 2},
    }
    return base | changes


def test_check_same_job_names_the_settings_and_processes_that_differ(monkeypatch):
    from jax.experimental import multihost_utils

    from jaxinfer import distributed

    digests = []
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: digests.append(x) or np.stack([x, x]))
    distributed.check_same_job(_settings())
    distributed.check_same_job(_settings(extra={"b": 2, "a": 1}))  # a dict's order does not count
    assert digests[0].dtype == np.int32 and digests[0].tolist() == digests[1].tolist()
    leader = digests[0]
    # Process 1 of 3 with another page count and mesh; process 2 like process 0.
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert not distributed.is_leader()
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([leader, x, leader]))
    with pytest.raises(distributed.JobMismatchError) as e:
        distributed.check_same_job(_settings(num_kv_pages=40, mesh="data=2,model=4"))
    message = str(e.value)
    assert 'mesh (processes [1] differ from process 0; here, on process 1: "data=2,model=4")' in message
    assert "num_kv_pages (processes [1] differ from process 0; here, on process 1: 40)" in message
    assert "dtype" not in message and "page_size" not in message and "extra" not in message
    # Unequal device counts: refused by name before the collective, which needs equal ones.
    devices = [type("D", (), {"process_index": p})() for p in (0, 0, 0, 0, 1, 1)]
    monkeypatch.setattr(jax, "devices", lambda: devices)
    with pytest.raises(
        distributed.JobMismatchError, match=r"different numbers of devices \(process 0: 4, process 1: 2\)"
    ):
        distributed.check_same_job(_settings())


def test_the_model_fingerprint_ignores_where_the_files_are_but_not_their_names(tmp_path):
    from jaxinfer.distributed import model_fingerprint

    for host in ("a", "b"):
        (tmp_path / host / "sub").mkdir(parents=True)
        (tmp_path / host / "sub" / "weights.bin").write_bytes(b"w" * 1000)
        (tmp_path / host / "config.json").write_text("{}")
    assert model_fingerprint(str(tmp_path / "a")) == model_fingerprint(str(tmp_path / "b"))  # paths differ per host
    (tmp_path / "b" / "sub" / "weights.bin").rename(tmp_path / "b" / "sub" / "other.bin")
    assert model_fingerprint(str(tmp_path / "a")) != model_fingerprint(str(tmp_path / "b"))
    assert model_fingerprint("embedded:tiny-random") == "embedded:tiny-random"  # a name, not a directory


def test_the_model_fingerprint_does_not_depend_on_the_order_directories_are_listed_in(tmp_path, monkeypatch):
    """os.walk lists a directory's entries in the filesystem's order, which may differ per host."""
    from jaxinfer.distributed import model_fingerprint

    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "shard.bin").write_bytes(sub.encode() * 10)
    walk = os.walk
    prints = set()
    for reverse in (False, True):

        def listed(top, reverse=reverse):
            for root, dirs, files in walk(top):
                dirs.sort(reverse=reverse)  # in place: the order os.walk then descends in
                yield root, dirs, files

        monkeypatch.setattr(os, "walk", listed)
        prints.add(model_fingerprint(str(tmp_path)))
    assert len(prints) == 1


def test_the_join_guard_says_what_is_missing_and_ends_only_a_process_that_never_joined(monkeypatch, capsys):
    from jaxinfer.distributed import _JoinGuard

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        up = f"127.0.0.1:{listener.getsockname()[1]}"
        nobody = f"127.0.0.1:{_free_port()}"
        assert _JoinGuard(3, None, None, None).message() == (
            "this process waited 3 s to join the multi-host job that JAX detected, and the job did not form"
        )
        assert (
            _JoinGuard(12, up, 3, 0)
            .message()
            .startswith(f"process 0 of 3 waited 12 s to join the multi-host job at {up}: not all 3 processes joined")
        )
        assert "the coordinator answers, but the job did not form" in _JoinGuard(3, up, 3, 1).message()
        assert "nothing answers there (Connection refused)" in _JoinGuard(3, nobody, 2, 1).message()
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    with _JoinGuard(0.1, up, 2, 0):  # joined at once: the guard stands down
        pass
    time.sleep(0.3)
    assert exits == []
    with _JoinGuard(0.1, up, 2, 0):  # still joining when its time is up: status 2, and why
        time.sleep(0.5)
    assert exits == [2]
    assert "error: process 0 of 2 waited 0.1 s to join the multi-host job" in capsys.readouterr().err


def test_the_join_guard_spares_a_process_that_joins_while_it_makes_its_message(monkeypatch):
    """The guard's message may take seconds (it tries the coordinator); a job that forms meanwhile
    keeps this process: ended after joining, it would abort its peers."""
    from jaxinfer import distributed

    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(distributed._JoinGuard, "message", lambda self: time.sleep(0.5) or "slow")
    with distributed._JoinGuard(0.1, "127.0.0.1:1", 2, 1):
        time.sleep(0.3)  # joined while the guard, its time up, is still making its message
    time.sleep(0.6)
    assert exits == []


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_initialize_hands_jax_its_settings_and_refuses_a_job_of_another_size(monkeypatch):
    """The guard's bound is the given one and JAX's own (an abort) well past it; the runtime is put in
    its recoverable mode with gloo on CPU; a non-loopback address binds JAX's default; a count the
    coordinator contradicts, or a partial set of flags, is refused."""
    from jaxinfer import distributed

    joined, updates, guards = [], [], []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: updates.append(a))
    monkeypatch.setattr(jax, "process_count", lambda: 2)

    class Guard:
        def __init__(self, *args):
            guards.append(args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(distributed, "_JoinGuard", Guard)
    port = _free_port()
    distributed.initialize(f"192.0.2.1:{port}", 2, 0, initialization_timeout=2.5)  # not this host's address
    if _has_ipv6_loopback():
        distributed.initialize(f"[::1]:{port}", 2, 0)
        assert joined[-1]["coordinator_bind_address"] == f"[::1]:{port}"
    assert guards[0] == (2.5, f"192.0.2.1:{port}", 2, 0)
    assert joined[0]["initialization_timeout"] >= 2.5 + 10 and joined[0]["coordinator_bind_address"] is None
    assert ("jax_enable_recoverability", True) in updates
    if jax.config.jax_platforms in (None, "", "cpu"):
        assert ("jax_cpu_collectives_implementation", "gloo") in updates
    for told, counted in ((3, 2), (2, 3)):
        monkeypatch.setattr(jax, "process_count", lambda counted=counted: counted)
        with pytest.raises(ValueError, match=rf"--num-processes {told} differs from the job's: .* counts {counted}"):
            distributed.initialize(f"127.0.0.1:{port}", told, 1)
    for partial in ((f"127.0.0.1:{port}", 2, None), (None, 2, 0), (f"127.0.0.1:{port}", None, None)):
        with pytest.raises(ValueError, match="give --coordinator-address, --num-processes and --process-id together"):
            distributed.initialize(*partial)
