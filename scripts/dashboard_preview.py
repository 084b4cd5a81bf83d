"""Draw docs/deploy/grafana-kvstore.json's panels from a live daemon, through a real Prometheus.

Grafana is not needed to see what the dashboard shows: this starts a daemon (a small CPU tier over
a disk tier, so blocks are evicted, demoted and promoted), a Prometheus server scraping its
``/metrics`` every second, and a client that Puts chained blocks, Gets some back (CPU and disk
hits) and Looks up keys nobody stored (misses). Then it asks Prometheus for every panel's own
PromQL, as written in the dashboard (``$instance`` = every instance, ``$__rate_interval`` = 5s),
and draws each panel's series in the dashboard's order, one picture:

    python scripts/dashboard_preview.py --prometheus /usr/bin/prometheus --out docs/deploy/dashboard.png

A panel whose queries return no data is drawn empty with "no data": that is a query the dashboard
gets wrong against this daemon (tests/test_deploy.py checks the series names; this checks that the
expressions evaluate).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_adapter.client.kvstore_client import KVStoreClient  # noqa: E402
from kvstore.keys import KVLayout, Namespace, prefix_keys  # noqa: E402
from kvstore.spawn import DaemonProcess  # noqa: E402

DASHBOARD = ROOT / "docs" / "deploy" / "grafana-kvstore.json"
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")
NS = Namespace("dashboard-preview", LAYOUT, chunk_tokens=256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def promql(expr: str) -> str:
    """A panel's expression as Grafana would send it for every instance."""
    return expr.replace("$__rate_interval", "5s").replace('instance=~"$instance"', 'instance=~".*"')


def query_range(prom: str, expr: str, start: float, end: float) -> list[dict]:
    args = urllib.parse.urlencode({"query": promql(expr), "start": start, "end": end, "step": 1})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{args}", timeout=10) as reply:
        body = json.load(reply)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {body}")
    return body["data"]["result"]


def drive(address: str, seconds: float, progress) -> None:
    """Puts, Gets and Lookups for ``seconds``: chains of 4 blocks, re-read while young, and misses."""
    rng = np.random.default_rng(0)
    payload = rng.standard_normal(LAYOUT.block_bytes(256) // 2).astype(np.float16)
    recent: list[list[bytes]] = []
    end = time.monotonic() + seconds
    shown = None
    with KVStoreClient(address) as client:
        while time.monotonic() < end:
            tokens = rng.integers(0, 49152, size=4 * 256).tolist()
            keys = prefix_keys(NS, tokens)
            client.put(NS, [(k, 256, payload, keys[i - 1] if i else b"", tokens[i * 256 : (i + 1) * 256])
                            for i, k in enumerate(keys)])
            recent = (recent + [keys])[-12:]
            old = recent[int(rng.integers(0, len(recent)))]
            client.get(old[:2], LAYOUT.block_bytes(256))  # some in the CPU tier, some only on disk
            client.lookup(prefix_keys(NS, rng.integers(0, 49152, size=512).tolist()))  # a miss
            left = max(0, round(end - time.monotonic()))
            if left != shown:
                progress(left)
                shown = left
            time.sleep(0.05)


def draw(panels: list[dict], series: list[list[tuple[str, list[dict]]]], start: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(13, 2.6 * rows), squeeze=False)
    fig.suptitle("kvstore dashboard (docs/deploy/grafana-kvstore.json), its queries on a live daemon through "
                 "Prometheus", fontsize=11)
    for ax, panel, results in zip(axes.flat, panels, series):
        ax.set_title(panel.get("title", ""), fontsize=9)
        drawn = 0
        for legend, result in results:
            for item in result:
                values = item["values"]
                t = [float(v[0]) - start for v in values]
                y = [float(v[1]) for v in values]
                labels = ",".join(f"{k}={v}" for k, v in sorted(item["metric"].items()) if k not in ("instance", "job"))
                ax.plot(t, y, linewidth=1.2, label=(legend or labels or "value").replace("{{tier}}", item["metric"].get(
                    "tier", "")).replace("{{method}}", item["metric"].get("method", "")).replace(
                    "{{rpc}}", item["metric"].get("rpc", "")))
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        else:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("s", fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", default=shutil.which("prometheus") or "",
                        help="the prometheus server binary (Debian's package 'prometheus'; default: on PATH)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the client drives the daemon (60)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "deploy" / "dashboard.png", help="the PNG written")
    args = parser.parse_args()
    if not args.prometheus or not Path(args.prometheus).exists():
        parser.error("no prometheus binary: install Debian's 'prometheus' package or give --prometheus PATH")

    panels = json.loads(DASHBOARD.read_text())["panels"]
    folder = Path(tempfile.mkdtemp(prefix="kvs-dashboard-"))
    metrics_port, prom_port = free_port(), free_port()
    (folder / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: kvstore\n    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
    daemon = DaemonProcess({"listen": f"unix:{folder / 'kvstore.sock'}", "cpu_capacity": "6MiB",
                            "disk_path": str(folder / "disk"), "disk_capacity": "24MiB", "disk_fsync": "false",
                            "metrics_listen": f"127.0.0.1:{metrics_port}", "log_level": "WARNING",
                            "tenant_secret_file": str(folder / "secret")}, log_path=folder / "daemon.log")
    prom = None
    try:
        daemon.start()
        prom = subprocess.Popen([args.prometheus, f"--config.file={folder / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={folder / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=(folder / "prometheus.log").open("wb"))
        start = time.time()
        drive(daemon.address, args.seconds,
              lambda left: print(f"\rdriving the daemon: {left:3d} s left", end="", file=sys.stderr, flush=True))
        time.sleep(3)  # the last scrapes
        print(file=sys.stderr)
        prom_url = f"http://127.0.0.1:{prom_port}"
        series = []
        for panel in panels:
            results = [(t.get("legendFormat", ""), query_range(prom_url, t["expr"], start, time.time()))
                       for t in panel.get("targets", [])]
            empty = [t["expr"] for t, (_, r) in zip(panel.get("targets", []), results) if not r]
            print(f"{panel.get('title')}: {sum(len(r) for _, r in results)} series"
                  + (f"; no data from {len(empty)} of its queries" if empty else ""))
            series.append(results)
        draw(panels, series, start, args.out)
        print(f"wrote {args.out}")
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
