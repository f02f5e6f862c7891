"""``kvgate bench redbook``: the three benchmarks of the IBM/NVIDIA/Supermicro "Context Without Limits"
Redbook, scaled to this machine, through a kvgate gateway (``kv`` policy, in-memory index) in front of two
real vLLM CPU servers, with kvgate's G4 connector (``cache_tier.connector``) on a directory of the local
disk. Each server's GPU-tier KV cache is forced minimal (``--num-gpu-blocks-override``: one block more than
``max_model_len`` needs), so what a server cannot hold must come from G4 or be recomputed.

1. TTFT vs context: a fresh prompt cold (nothing cached: full prefill), then the same prompt after both
   servers' prefix caches were emptied: every full block is loaded from G4. Growth over the range, both.
2. Concurrent throughput: N requests over N/2 unique prompts (each used twice, the second pass after all
   the others), C in flight, from an empty cache: servers without the connector (G4 off), then with it.
3. Noisy neighbour: run 2 with G4 on again (fresh prompts) while processes write and read junk files on
   the G4 directory's filesystem (``bench.redbook_noise``); its bandwidth is measured.

It prints the table beside the Redbook's figures (ratios; ``bench.redbook_report``), and writes
``redbook.json`` and ``redbook.png`` under ``--out``. ``--quick``: one server per fleet, contexts up to
2K tokens, 8 short requests: a smoke run of a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "m"  # the served model name

FULL = dict(servers=2, size="152m", max_model_len=8192, sizes="2048,4096,6144,8160", reps=3, requests=32,
            prompt_tokens="3072,6144", max_tokens=8, noise_cap_mib=2048, noise_file_mib=64)
QUICK = dict(servers=1, size="152m", max_model_len=2048, sizes="512,2016", reps=1, requests=8,
             prompt_tokens="512,1024", max_tokens=4, noise_cap_mib=256, noise_file_mib=16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, short prompts, few requests")
    p.add_argument("--servers", type=int, choices=(1, 2), default=None,
                   help="vLLM servers (default 2, --quick 1)")
    p.add_argument("--size", default=None, help="bench model: 152m (default) or tiny")
    p.add_argument("--max-model-len", type=int, default=None, help="default 8192 (--quick 2048)")
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="KV blocks per server (default: max_model_len / 32 + 1, the least vLLM accepts)")
    p.add_argument("--sizes", default=None, help="TTFT prompt sizes (default 2048,4096,6144,8160)")
    p.add_argument("--reps", type=int, default=None, help="fresh prompts per size (default 3)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests of runs 2-3, over half as many unique prompts (default 32)")
    p.add_argument("--concurrency", type=int, default=None, help="in flight (default requests / 2)")
    p.add_argument("--prompt-tokens", default=None,
                   help="min,max prompt tokens of runs 2-3 (default 3072,6144)")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 8)")
    p.add_argument("--noise-writers", type=int, default=2)
    p.add_argument("--noise-readers", type=int, default=2)
    p.add_argument("--noise-cap-mib", type=int, default=None, help="space the noise may use (default 2048)")
    p.add_argument("--noise-file-mib", type=int, default=None, help="noise file size (default 64)")
    p.add_argument("--no-noise", action="store_true", help="skip benchmark 3")
    p.add_argument("--connector-extra", default="{}",
                   help="JSON merged into kv_connector_extra_config, e.g. '{\"load_async\": false}'")
    p.add_argument("--g4-dir", default=None, help="parent of the G4 directory (default: the temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for redbook.json and redbook.png "
                   "(default bench/results/redbook, --quick: redbook-quick)")
    p.add_argument("--no-progress", action="store_true")


def settings(args) -> argparse.Namespace:
    """The arguments with the mode's defaults filled in."""
    base = QUICK if args.quick else FULL
    s = argparse.Namespace(**vars(args))
    for k, v in base.items():
        if getattr(s, k, None) is None:
            setattr(s, k, v)
    s.gpu_blocks = s.gpu_blocks or s.max_model_len // 32 + 1
    s.concurrency = s.concurrency or max(1, s.requests // 2)
    s.out = s.out or str(ROOT / "bench" / "results" / ("redbook-quick" if args.quick else "redbook"))
    s.connector_extra = json.loads(args.connector_extra) if isinstance(args.connector_extra, str) else \
        args.connector_extra
    return s


def servers(model_dir: str, s, g4: str | None) -> list:
    from bench.vllm_server import VllmServer, one_core_each

    return [
        VllmServer(model_dir, name=f"vllm-{i}", served_model_name=MODEL, omp_threads_bind=bind,
                   max_model_len=s.max_model_len, num_gpu_blocks=s.gpu_blocks,
                   extra_args=["--dtype", "bfloat16"], g4_path=g4,
                   g4_config=s.connector_extra if g4 else None)
        for i, bind in enumerate(one_core_each(s.servers))
    ]


class Fleet:
    """Two vLLM servers (with the connector on ``g4`` when given) and a kvgate gateway in front of them."""

    def __init__(self, model_dir: str, s, workdir: Path, g4: str | None) -> None:
        self.model_dir, self.s, self.workdir, self.g4 = model_dir, s, workdir, g4
        self.servers = servers(model_dir, s, g4)

    def __enter__(self) -> "Fleet":
        from bench.bench_vllm_policies import Gateway
        from bench.redbook_runs import one
        from bench.vllm_server import start_all

        start_all(self.servers)
        try:
            gw_dir = self.workdir / ("g4" if self.g4 else "nog4")
            self.gw = Gateway(self.servers, self.model_dir, "kv", gw_dir, model=MODEL).__enter__()
            for srv in self.servers:  # first requests are slower (allocation, thread pools)
                one(srv.url, MODEL, list(range(10, 10 + 3 * 32)))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        gw = getattr(self, "gw", None)
        if gw is not None:
            gw.__exit__()
        for srv in self.servers:
            srv.close()


def throughput(fleet: Fleet, s, variant: int, label: str, progress: bool) -> dict:
    from tqdm import tqdm

    from bench.bench_vllm_policies import reset_caches
    from bench.redbook_runs import concurrent, scrape, workload

    lo, hi = (int(x) for x in s.prompt_tokens.split(","))
    prompts = workload(s.requests, lo, hi, s.seed, variant)
    reset_caches(fleet.servers)
    before = [scrape(x.url) for x in fleet.servers]
    with tqdm(total=len(prompts), desc=label, disable=not progress, unit="req") as bar:
        r = concurrent(fleet.gw.url, MODEL, prompts, s.concurrency, s.max_tokens, bar)
    after = [scrape(x.url) for x in fleet.servers]
    # what reuse alone can save: prompt tokens sent / prompt tokens of the unique prompts
    r["reuse_ceiling_x"] = sum(map(len, prompts)) / sum(len(p) for p in {tuple(p) for p in prompts})
    r["preemptions"] = sum(a[k] - b[k] for a, b in zip(after, before) for k in a)
    r["loadavg"] = os.getloadavg()
    if fleet.g4:
        r["g4_stats"] = [x.g4_stats() for x in fleet.servers]
    return r


def run_all(s) -> dict:
    from tqdm import tqdm

    from bench import tiny_model

    progress = not s.no_progress
    model_dir = str(tiny_model.ensure(s.size))
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-redbook-"))
    for d in ("g4", "nog4"):
        (workdir / d).mkdir()
    g4_parent = s.g4_dir or tempfile.gettempdir()
    g4 = tempfile.mkdtemp(prefix="kvgate-redbook-g4-", dir=g4_parent)
    res: dict = {"args": dict(vars(s)), "loadavg_start": os.getloadavg(), "throughput": {}}
    t0 = time.monotonic()
    log = tqdm.write if progress else print
    log(f"kvgate bench redbook: model {s.size}, {s.servers} vLLM CPU server(s) x {s.gpu_blocks} KV blocks "
        f"(max_model_len {s.max_model_len}), logs under {workdir}")

    log(f"G4 off: starting {s.servers} vLLM server(s) without the connector and a kvgate gateway ...")
    with Fleet(model_dir, s, workdir, None) as fleet:
        res["phase_s"] = {"start_off": time.monotonic() - t0}
        res["throughput"]["off"] = throughput(fleet, s, 0, "2. throughput, G4 off", progress)
    log(f"G4 on: starting {s.servers} vLLM server(s) with kvgate's connector on {g4} ...")
    try:
        measure_g4(res, s, Fleet(model_dir, s, workdir, g4), g4_parent, progress)
    finally:
        shutil.rmtree(g4, ignore_errors=True)
    res["elapsed_s"] = time.monotonic() - t0
    res["loadavg_end"] = os.getloadavg()
    return res


def measure_g4(res: dict, s, fleet: Fleet, g4_parent: str, progress: bool) -> None:
    """Benchmarks 1, 2 (G4 on) and 3 on the fleet with the connector."""
    from tqdm import tqdm

    from bench.redbook_noise import NoisyNeighbour
    from bench.redbook_runs import ttft_curve

    t1 = time.monotonic()
    with fleet:
        res["phase_s"]["start_on"] = time.monotonic() - t1
        sizes = [int(x) for x in s.sizes.split(",")]
        with tqdm(total=len(sizes) * s.reps, desc="1. TTFT vs context", disable=not progress) as bar:
            res["ttft"] = ttft_curve(fleet.gw.url, MODEL, fleet.servers, sizes, s.reps, s.seed + 100, bar)
        res["ttft_loadavg"] = os.getloadavg()
        res["throughput"]["on"] = throughput(fleet, s, 0, "2. throughput, G4 on", progress)
        if not s.no_noise:
            with NoisyNeighbour(g4_parent, s.noise_writers, s.noise_readers, s.noise_file_mib,
                                s.noise_cap_mib, max_s=1800) as nn:
                time.sleep(2.0)  # readers write their files first
                nn.mark()
                res["throughput"]["noisy"] = throughput(fleet, s, 1, "3. noisy neighbour", progress)
            res["noise"] = nn.result()


def run(args) -> int:
    from bench import redbook_report as rr

    s = settings(args)
    res = run_all(s)
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    res["title"] = (f"kvgate bench redbook{' --quick' if s.quick else ''}: {s.size} model, "
                    f"{s.servers} vLLM CPU server(s), G4 on the local disk")
    (out / "redbook.json").write_text(json.dumps(res, indent=1) + "\n")
    png = rr.plot(res, out / "redbook.png")
    print()
    print(rr.table(res))
    on, off = res["throughput"]["on"], res["throughput"]["off"]
    print(f"\nthroughput runs: {off['requests']} requests over {off['requests'] // 2} unique prompts, "
          f"{s.concurrency} concurrent")
    for name, r in res["throughput"].items():
        print(f"  {name}: {r['total_s']:.1f} s, cached {r['cached_share']:.0%}, {r['preemptions']:.0f} preemptions, "
              f"requests per worker {r['per_worker']}, load average {r['loadavg'][0]:.1f}")
    la = res["loadavg_start"], res["loadavg_end"]
    print(f"load average at start {la[0][0]:.2f}, at end {la[1][0]:.2f}; total {res['elapsed_s']:.0f} s")
    print(f"plot: {png}\nraw results: {out / 'redbook.json'}")
    return 0
