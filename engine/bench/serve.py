"""`python -m engine.bench serve`: load test of `python -m engine.serve` with a real OpenAI client.

    python -m engine.bench serve                                   # target-only, static K, learned; ~3 min
    python -m engine.bench serve serve_bench.rates=[1,4] serve_bench.requests=8 serve_bench.policies=[none,static-3]

Per policy: start the server on loopback (a subprocess, zoo target + EAGLE head + expert predictor), wait for
/health, then for every request rate a Poisson arrival process of `requests` streaming completions (seeded
gaps, bounded by count and by `timeout_s`), and one burst of `burst` requests at once; measured client side
with the `openai` package: TTFT (send -> first content chunk), ITL (between streamed chunks: one per round, so
several tokens under speculation), TPOT ((last - first chunk) / (completion tokens - 1), tokens from the
usage), request and output throughput, P50 / P95 / P99; server side from /metrics: τ, drafted / accepted
tokens and committed tokens per target cost (Σ committed / Σ T_spec/T_AR, every round priced by the server's
roofline of `serve_bench.cost_hardware`, default h200: the modelled speed-up over plain decoding).
Target-only, static speculation and the learned policy run side by side in one process, one after the other
(never two servers at once). Not a timed test: figures go to the README.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from engine.bench.common import learned_policy
from engine.bench.configs import ServeBenchConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m engine.serve` as a subprocess on a free loopback port (SIGTERM on exit)."""

    def __init__(self, policy: str, max_batch: int, cost_hardware: str = "h200") -> None:
        self.port = _free_port()
        drafter = [] if policy == "none" else ["drafter=eagle-head", "predictor=expert-predictor"]
        cmd = [sys.executable, "-m", "engine.serve", f"policy={policy}", f"port={self.port}", f"max_batch={max_batch}",
               "threads=1", f"cost_hardware={cost_hardware}", *drafter]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 120.0) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("server did not become healthy")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^expertspec:(spec_rounds|spec_committed_tokens|spec_decode_num_draft_tokens|"
                         r"spec_decode_num_accepted_tokens|generation_tokens|spec_round_cost_ar_steps)_total (\S+)$",
                         line)  # fmt: skip
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def _one(client: Any, prompt: str, max_tokens: int, seed: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    times, tokens = [], 0
    stream = await client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, seed=seed,
                                             stream_options={"include_usage": True})  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if getattr(chunk, "usage", None):
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"t0": t0, "times": times, "end": end, "tokens": tokens or len(times)}


async def scenario(url: str, prompts: list[str], gaps: list[float], max_tokens: int, timeout_s: float) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout_s)
    tasks = []
    t_start = time.perf_counter()
    for i, (p, g) in enumerate(zip(prompts, gaps)):
        await asyncio.sleep(g)
        tasks.append(asyncio.create_task(_one(client, p, max_tokens, i)))
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    wall = time.perf_counter() - t_start
    res = [t.result() for t in done if not t.exception()]
    ttft = [r["times"][0] - r["t0"] for r in res if r["times"]]
    itl = [b - a for r in res for a, b in zip(r["times"], r["times"][1:])]  # between streamed chunks (rounds)
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in res if len(r["times"]) > 1 < r["tokens"]]
    tokens = sum(r["tokens"] for r in res)

    def pct(xs: list[float]) -> dict[str, float]:
        if not xs:
            return {}
        xs = sorted(xs)
        at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
        return {"p50": statistics.median(xs), "p95": at(0.95), "p99": at(0.99)}

    await client.close()
    return {"completed": len(res), "failed": len(tasks) - len(res), "wall_s": wall, "req_per_s": len(res) / wall,
            "out_tok_per_s": tokens / wall, "ttft": pct(ttft), "itl": pct(itl), "tpot": pct(tpot)}  # fmt: skip


def bench_serve(cfg: Any, progress=None) -> dict:
    from engine.workloads import workload

    c: ServeBenchConfig = cfg.serve_bench
    rng = random.Random(c.seed)
    texts = [p.text for p in workload("mixed", max(c.requests, c.burst))]
    out: dict[str, Any] = {"config": dict(vars(c)), "policies": {}}
    for policy in c.policies:
        spec = learned_policy(c.learned_path) if policy == "learned" else policy
        if Path(policy).is_dir():  # a frozen policy folder named directly: label it by its cost model
            policy = f"learned:{Path(policy).parents[1].name}"
        server = Server(spec, c.max_batch, c.cost_hardware)
        try:
            server.wait()
            rows = {}
            for rate in c.rates:
                gaps = [0.0] + [rng.expovariate(rate) for _ in range(c.requests - 1)]
                before = server.metrics()
                rows[f"poisson {rate:g}/s"] = asyncio.run(scenario(server.url, texts[: c.requests], gaps, c.max_tokens,
                                                                   c.timeout_s))  # fmt: skip
                rows[f"poisson {rate:g}/s"]["server"] = _delta(before, server.metrics())
                if progress:
                    progress()
            before = server.metrics()
            rows["burst"] = asyncio.run(scenario(server.url, texts[: c.burst], [0.0] * c.burst, c.max_tokens,
                                                 c.timeout_s))  # fmt: skip
            rows["burst"]["server"] = _delta(before, server.metrics())
            if progress:
                progress()
            out["policies"][policy] = {"policy": spec, "scenarios": rows}
        finally:
            server.stop()
    return out


def _delta(a: dict, b: dict) -> dict:
    d = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}
    rounds = d.get("spec_rounds", 0.0)
    d["tau"] = d.get("spec_committed_tokens", 0.0) / rounds if rounds else float("nan")
    steps = d.get("spec_round_cost_ar_steps", 0.0)  # Σ T_spec / T_AR under the server's cost model
    d["utility"] = d.get("spec_committed_tokens", 0.0) / steps if steps else float("nan")
    return d


def print_serve(res: dict) -> None:
    print("\n== serving load test (openai client, streaming, loopback; client-side latencies in ms) ==")
    print(f"{'policy':<10} {'scenario':<14} {'ok':>4} {'req/s':>6} {'tok/s':>7} {'TTFT p50/p95/p99':>20} "
          f"{'TPOT p50/p95/p99':>20} {'ITL p50/p99':>13} {'τ':>5} {'tok/cost':>8}")  # fmt: skip
    ms = lambda d, *ks: "/".join(f"{d[k] * 1e3:.0f}" for k in ks) if d else "-"  # noqa: E731
    for pol, r in res["policies"].items():
        for name, s in r["scenarios"].items():
            print(f"{pol:<10} {name:<14} {s['completed']:>4} {s['req_per_s']:>6.2f} {s['out_tok_per_s']:>7.1f} "
                  f"{ms(s['ttft'], 'p50', 'p95', 'p99'):>20} {ms(s['tpot'], 'p50', 'p95', 'p99'):>20} "
                  f"{ms(s['itl'], 'p50', 'p99'):>13} {s['server'].get('tau', float('nan')):>5.2f} "
                  f"{s['server'].get('utility', float('nan')):>8.2f}")  # fmt: skip


def plot_serve(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for pol, r in res["policies"].items():
        pts = [(float(k.split()[1].rstrip("/s")), s["tpot"].get("p50", float("nan")) * 1e3)
               for k, s in r["scenarios"].items() if k.startswith("poisson")]  # fmt: skip
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=pol)
    ax.set(xscale="log", xlabel="request rate (req/s, Poisson)", ylabel="P50 TPOT (ms)",
           title="TPOT vs request rate (tiny zoo model, 2 CPU cores)")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
