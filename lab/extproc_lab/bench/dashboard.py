"""The shipped Grafana dashboard's panels, drawn from real demo traffic (Grafana cannot run here).

    python -m extproc_lab.bench.dashboard --out docs/images/dashboard.png

Starts the demo's fleet (simulated A10G engines behind real Envoy + llm-extproc + Redis + the
publisher), sends the shared-prefix workload plus a few malformed requests, and scrapes the service's,
the publisher's and the engines' /metrics every `--scrape` seconds, as Prometheus would (job labels as
in compose/monitoring/prometheus.yml). Each panel's own PromQL, read from
deploy/monitoring/grafana-dashboard.json, is then evaluated over those scrapes by a small evaluator for
the query shapes the dashboard uses (sum/max/min by, rate, histogram_quantile, a ratio of rates,
time() - x), and the panels are laid out on the dashboard's own grid with matplotlib.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "monitoring" / "grafana-dashboard.json"
RATE_WINDOW = 4  # scrapes in a rate() window ($__rate_interval = 4 x the scrape interval)
Labels = tuple[tuple[str, str], ...]
Series = dict[Labels, list[tuple[float, float]]]


@dataclass(slots=True)
class Scrape:
    """One round of scrapes: unix time and every sample as (name, labels) -> value."""

    t: float
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)


def parse_metrics(text: str, extra: dict[str, str]) -> dict[tuple[str, Labels], float]:
    out: dict[tuple[str, Labels], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted({**s.labels, **extra}.items()))
            out[(s.name, labels)] = float(s.value)
    return out


# -- a PromQL subset ----------------------------------------------------------------------------------
_MATCHER = re.compile(r'(\w+)\s*(=~|!=|=)\s*"([^"]*)"')


def _matchers(selector: str, variables: dict[str, str]) -> list[tuple[str, str, str]]:
    out = []
    for name, op, value in _MATCHER.findall(selector or ""):
        for var, sub in variables.items():
            value = value.replace(f"${var}", sub)
        out.append((name, op, value))
    return out


def _matches(labels: Labels, matchers: list[tuple[str, str, str]]) -> bool:
    d = dict(labels)
    for name, op, value in matchers:
        got = d.get(name, "")
        if op == "=" and got != value:
            return False
        if op == "!=" and got == value:
            return False
        if op == "=~" and not re.fullmatch(value, got):
            return False
    return True


def _split_top(expr: str, sep: str) -> list[str] | None:
    """`expr` split at a top-level `sep` (outside parentheses and braces), or None."""
    depth = 0
    for i, ch in enumerate(expr):
        depth += ch in "({"
        depth -= ch in ")}"
        if depth == 0 and expr.startswith(sep, i):
            return [expr[:i].strip(), expr[i + len(sep) :].strip()]
    return None


_SELECTOR = re.compile(r"^([\w:]+)(\{[^}]*\})?$")
_RATE = re.compile(r"^rate\(([\w:]+)(\{[^}]*\})?\[[^\]]+\]\)$")
_AGG = re.compile(r"^(sum|max|min)(?: by \(([^)]*)\))?\s*\((.*)\)$")
_QUANTILE = re.compile(r"^histogram_quantile\(([\d.]+), (.*)\)$")


class Evaluator:
    """Evaluates the dashboard's expressions over a list of scrapes; each result is a Series."""

    def __init__(self, scrapes: list[Scrape], variables: dict[str, str]) -> None:
        self.scrapes = scrapes
        self.variables = variables

    def evaluate(self, expr: str) -> Series:
        expr = expr.strip()
        if expr.startswith("time() - "):
            inner = self.evaluate(expr.removeprefix("time() - "))
            return {k: [(t, t - v) for t, v in pts] for k, pts in inner.items()}
        ratio = _split_top(expr, " / ")
        if ratio is not None:
            num, den = (self.evaluate(x) for x in ratio)
            out: Series = {}
            for k, pts in num.items():
                dens = dict(den.get(k, []))
                out[k] = [(t, v / dens[t]) for t, v in pts if dens.get(t)]
            return out
        if m := _QUANTILE.fullmatch(expr):
            return self._quantile(float(m.group(1)), self.evaluate(m.group(2)))
        if m := _AGG.fullmatch(expr):
            by = [x.strip() for x in (m.group(2) or "").split(",") if x.strip()]
            return self._aggregate(m.group(1), by, self.evaluate(m.group(3)))
        if m := _RATE.fullmatch(expr):
            return self._rate(m.group(1), _matchers(m.group(2), self.variables))
        if m := _SELECTOR.fullmatch(expr):
            return self._instant(m.group(1), _matchers(m.group(2), self.variables))
        raise ValueError(f"unsupported expression: {expr}")

    def _instant(self, name: str, matchers: list[tuple[str, str, str]]) -> Series:
        out: Series = {}
        for s in self.scrapes:
            for (n, labels), v in s.samples.items():
                if n == name and _matches(labels, matchers):
                    out.setdefault(labels, []).append((s.t, v))
        return out

    def _rate(self, name: str, matchers: list[tuple[str, str, str]]) -> Series:
        out: Series = {}
        for labels, pts in self._instant(name, matchers).items():
            rates = []
            for i in range(1, len(pts)):
                t0, v0 = pts[max(0, i - RATE_WINDOW)]
                t1, v1 = pts[i]
                if t1 > t0:
                    rates.append((t1, max(0.0, v1 - v0) / (t1 - t0)))  # counters only grow here
            out[labels] = rates
        return out

    @staticmethod
    def _aggregate(op: str, by: list[str], series: Series) -> Series:
        fns: dict[str, Callable[[list[float]], float]] = {"sum": sum, "max": max, "min": min}
        fn = fns[op]
        groups: dict[Labels, dict[float, list[float]]] = {}
        for labels, pts in series.items():
            key = tuple((k, v) for k, v in labels if k in by)
            for t, v in pts:
                groups.setdefault(key, {}).setdefault(t, []).append(v)
        return {k: sorted((t, fn(vs)) for t, vs in by_t.items()) for k, by_t in groups.items()}

    @staticmethod
    def _quantile(q: float, buckets: Series) -> Series:
        """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q."""
        groups: dict[Labels, dict[float, list[tuple[float, float]]]] = {}
        for labels, pts in buckets.items():
            d = dict(labels)
            le = float(d.pop("le"))
            key = tuple(sorted(d.items()))
            for t, v in pts:
                groups.setdefault(key, {}).setdefault(t, []).append((le, v))
        out: Series = {}
        for key, by_t in groups.items():
            series = []
            for t, bs in sorted(by_t.items()):
                bs.sort()
                total = bs[-1][1]
                if total <= 0:
                    continue
                rank, prev_le, prev_c = q * total, 0.0, 0.0
                for le, c in bs:
                    if c >= rank:
                        if math.isinf(le):
                            value = prev_le
                        else:
                            value = prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-12)
                        series.append((t, value))
                        break
                    prev_le, prev_c = le, c
            out[key] = series
        return out


def _legend(fmt: str, labels: Labels) -> str:
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt or "") or "value"


# -- drawing -------------------------------------------------------------------------------------------
def render(scrapes: list[Scrape], out: Path, dashboard: Path = DASHBOARD, note: str = "") -> None:
    """Every panel of `dashboard` at its gridPos, evaluated over `scrapes`, into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(dashboard.read_text())
    ev = Evaluator(scrapes, {"job": "llm-extproc|llm-extproc-epp"})
    panels = doc["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    t0 = scrapes[0].t
    span = scrapes[-1].t - t0
    bg, fg, grid = "#111217", "#ccccdc", "#2c2f36"
    fig = plt.figure(figsize=(20, rows * 0.42), facecolor=bg)
    gs = fig.add_gridspec(rows, 24, hspace=1.6, wspace=1.4, left=0.04, right=0.99, top=0.95, bottom=0.03)
    fig.suptitle(f"{doc.get('title', 'dashboard')}  {note}", color=fg, fontsize=15, x=0.01, ha="left")
    for p in panels:
        g = p["gridPos"]
        ax = fig.add_subplot(gs[g["y"] : g["y"] + g["h"] - 1, g["x"] : g["x"] + g["w"]])
        ax.set_facecolor("#181b1f")
        for spine in ax.spines.values():
            spine.set_color(grid)
        ax.tick_params(colors=fg, labelsize=7)
        ax.set_title(p.get("title", ""), color=fg, fontsize=10, loc="left")
        lines: list[tuple[str, list[tuple[float, float]]]] = []
        for target in p.get("targets", []):
            for labels, pts in sorted(ev.evaluate(target["expr"]).items()):
                if pts:
                    lines.append((_legend(target.get("legendFormat", ""), labels), pts))
        if p.get("type") == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            value = lines[0][1][-1][1] if lines else None
            text = "No data" if value is None else f"{value:.3g}"
            unit = lines[0][0] if lines else ""
            ax.text(0.5, 0.55, text, color="#73bf69", fontsize=26, ha="center", va="center")
            ax.text(0.5, 0.2, unit, color=fg, fontsize=9, ha="center", va="center")
            continue
        if not lines:
            ax.text(0.5, 0.5, "No data", color=fg, ha="center", va="center", transform=ax.transAxes)
        for label, pts in lines:
            ax.plot([t - t0 for t, _ in pts], [v for _, v in pts], label=label, linewidth=1.4)
        ax.set_xlim(0, span)  # one time axis for every panel, as in Grafana
        ax.grid(color=grid, linewidth=0.6)
        ax.set_xlabel("s since start", color=fg, fontsize=7)
        if lines:
            ax.legend(fontsize=7, facecolor="#181b1f", edgecolor=grid, labelcolor=fg, loc="upper left")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=bg)
    plt.close(fig)


# -- the traffic -----------------------------------------------------------------------------------------
def _scrape(url: str, extra: dict[str, str]) -> dict[tuple[str, Labels], float]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return parse_metrics(r.read().decode(), extra)
    except OSError:
        return {}


async def collect(*, seconds: float, rate: float, scrape_s: float, workdir: Path) -> list[Scrape]:
    """Run the demo fleet under the shared-prefix workload for `seconds`, scraping every `scrape_s`."""
    import aiohttp

    from extproc.fleet.redis_feed import RedisSettings
    from extproc.publishers import InstanceSpec, Publisher, PublisherConfig
    from extproc_lab.bench.loadgen import open_loop
    from extproc_lab.bench.scenarios import MODEL, _n_cluster_gateway
    from extproc_lab.bench.workloads import make_workload, with_priorities
    from extproc_lab.engines import EngineGroup
    from extproc_lab.engines.profiles import PROFILES
    from extproc_lab.stack import free_port, local_redis

    group = EngineGroup([], MODEL, profiles=[PROFILES["a10g-llama3-8b"]] * 3)
    redis, notice = local_redis(workdir / "redis.log")
    clusters = {f"gpu-{i}": [p] for i, p in enumerate(group.ports)}
    gw = _n_cluster_gateway(workdir, clusters, redis.url)
    pub_port = free_port()
    publisher = Publisher(
        PublisherConfig(
            redis=RedisSettings(url=redis.url, pool="demo"),
            instances=[InstanceSpec(c, f"127.0.0.1:{p[0]}", "sim") for c, p in clusters.items()],
            interval_s=1.0,  # the shipped default (scrape deadline 0.8 s)
            metrics_listen=f"127.0.0.1:{pub_port}",
        )
    )
    stop = asyncio.Event()
    pub_task = asyncio.create_task(publisher.run(stop))
    scrapes: list[Scrape] = []
    sources = [(gw.metrics_url, {"job": "llm-extproc", "instance": f"127.0.0.1:{gw.metrics_port}"})]
    sources.append((f"http://127.0.0.1:{pub_port}/metrics", {"job": "llm-extproc-publisher"}))
    sources += [
        (f"http://127.0.0.1:{p}/metrics", {"job": "engines", "instance": f"127.0.0.1:{p}"})
        for p in group.ports
    ]

    async def scraper() -> None:
        while True:
            samples: dict[tuple[str, Labels], float] = {}
            for url, extra in sources:
                samples.update(await asyncio.to_thread(_scrape, url, extra))
            # Stamped when the round ends: `time() - <timestamp gauge>` must not come out negative.
            scrapes.append(Scrape(time.time(), samples))
            await asyncio.sleep(scrape_s)

    async def bad_requests(url: str) -> None:
        """A malformed request now and then, as real clients send: the error panel's data."""
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.sleep(5.0)
                for body in (b"{not json", b'{"model": "sim-llama"}'):
                    async with session.post(
                        url, data=body, headers={"content-type": "application/json"}
                    ) as r:
                        await r.read()

    try:
        gw.start()
        await asyncio.sleep(1.5)  # first snapshots in
        if notice != "redis-server":
            print(notice)
        count = int(seconds * rate)
        # Each request with a priority class (20 / 50 / 30 %), for the per-class panels.
        wl = with_priorities(
            make_workload("shared-prefix", rate=rate, count=count, seed=0, model=MODEL, tenants=64)
        )
        url = gw.url + "/v1/chat/completions"
        tasks = [asyncio.create_task(scraper()), asyncio.create_task(bad_requests(url))]
        await open_loop(
            url,
            [(r.arrival_s, r.body, r.tag) for r in wl.requests],
            progress="dashboard demo",
            headers=wl.headers,
        )
        await asyncio.sleep(3 * scrape_s)  # the tail of the last requests
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        stop.set()
        await pub_task
        gw.stop()
        redis.stop()
        group.close()
    return scrapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/images/dashboard.png", help="PNG to write")
    ap.add_argument("--seconds", type=float, default=60.0, help="length of the traffic")
    ap.add_argument("--rate", type=float, default=3.5, help="requests/s (the demo's rate)")
    ap.add_argument("--scrape", type=float, default=2.0, help="seconds between scrapes")
    ap.add_argument("--workdir", default="out/dashboard", help="logs of Envoy, the service and Redis")
    ap.add_argument("--from-scrapes", help="redraw from a scrapes.json an earlier run wrote (no traffic)")
    args = ap.parse_args(argv)
    note = f"(demo fleet: 3 simulated A10G engines, shared-prefix, {args.rate:g} req/s, {args.seconds:g} s)"
    if args.from_scrapes:
        raw = json.loads(Path(args.from_scrapes).read_text())
        loaded = [
            Scrape(r["t"], {(n, tuple(tuple(x) for x in lab)): v for n, lab, v in r["samples"]}) for r in raw
        ]
        render(loaded, Path(args.out), note=note)
        print(f"wrote {args.out} from {len(loaded)} scrapes")
        return 0
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    scrapes = asyncio.run(
        collect(seconds=args.seconds, rate=args.rate, scrape_s=args.scrape, workdir=workdir)
    )
    (workdir / "scrapes.json").write_text(
        json.dumps(
            [{"t": s.t, "samples": [[n, list(lab), v] for (n, lab), v in s.samples.items()]} for s in scrapes]
        )
    )
    render(scrapes, Path(args.out), note=note)
    print(f"wrote {args.out} from {len(scrapes)} scrapes (raw: {workdir / 'scrapes.json'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
