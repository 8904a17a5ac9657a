"""Draw one benchmark run (bench/run_all.py's JSONL records) as a self-contained HTML page of PNG plots.

    python bench/run_all.py --quick --report DIR      # run the benchmarks and draw them
    python bench/report.py RESULTS.jsonl DIR          # draw a recorded run again
    python bench/report.py --check DIR                # the page and its plots agree; exit 1 if not

DIR gets ``index.html`` (each plot embedded as a data URI, so the page alone can be mailed or attached)
and the same plots as ``<name>.png`` beside it.  A plot the run has no data for (bench_e2e needs root;
``--quick`` measures one node size) is a section saying what is missing and why, never an empty axis.
Needs matplotlib (``pip install -e '.[bench]'``); it draws with the Agg backend, no display.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

Record = dict[str, Any]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EXT, TWIN = "#1f6fb4", "#d9661f"  # the extension blue, the twin orange, in every plot


def matplotlib_missing() -> str | None:
    """None when matplotlib imports; else the one line saying how to install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return (
            f"needs matplotlib, which {sys.executable} cannot import ({e}): "
            "pip install -e '.[bench]' (or pip install matplotlib)"
        )
    return None


@dataclass(frozen=True)
class Drawn:
    """A plot that was drawn: its PNG bytes and a caption saying what it shows and what it lacks."""

    png: bytes
    caption: str


@dataclass(frozen=True)
class Missing:
    """A plot the run has no data for, and why."""

    reason: str


@dataclass(frozen=True)
class Plot:
    """One section of the page: a file name, a title and the function that draws it from the records."""

    name: str
    title: str
    draw: Callable[[list[Record]], Drawn | Missing]


def results(records: list[Record], script: str) -> list[Record]:
    """Every JSON document ``script`` printed in this run."""
    return [r["result"] for r in records if r.get("script") == script and r.get("result") is not None]


def absent(records: list[Record], script: str, what: str) -> Missing:
    """Why ``script`` left no figures: its own skip line when it printed one, else that it did not run."""
    ran = [r for r in records if r.get("script") == script]
    notes = [f"{r['note']} (exit {r['exit']})" for r in ran if r.get("result") is None and r.get("note")]
    if notes:
        return Missing(f"{what}: not measured in this run. {script}: {notes[0]}")
    if ran:
        return Missing(f"{what}: {script} ran but printed no figures for it.")
    return Missing(f"{what}: {script} did not run in this run.")


def _figure(width: float = 7.5, height: float = 4.2) -> Any:
    # Figure without pyplot: no global state and no GUI backend, whatever MPLBACKEND says.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _size_axis(ax: Any, sizes: list[int], label: str = "node size (VFs)") -> None:
    """A log2 x axis ticked at exactly the node sizes measured."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel(label)
    # Room either side of the outer points for their labels (a single size gets an octave each way).
    ax.set_xlim(
        min(sizes) / (2 if len(set(sizes)) == 1 else 1.4), max(sizes) * (2 if len(set(sizes)) == 1 else 1.4)
    )


def _log_ms(ax: Any) -> None:
    """A log y axis labelled in plain numbers at 1, 2 and 5 of each decade, so narrow ranges get labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())


def _headroom(ax: Any, values: list[float]) -> None:
    """A linear y axis from 0 with a quarter of headroom above the highest value, for the legend."""
    ax.set_ylim(0, max(values) * 1.3 if max(values) > 0 else 1)


def draw_scan(records: list[Record]) -> Drawn | Missing:
    """Scan time against VF count, extension and twin, log-log, each with a slope-1 (linear) reference."""
    docs = [d for d in results(records, "bench_scan") if d.get("nodes")]
    if not docs:
        return absent(records, "bench_scan", "sysfs scan time")
    doc = docs[-1]
    nodes = sorted(doc["nodes"], key=lambda n: n["vfs"])
    fig = _figure()
    ax = fig.add_subplot()
    vfs = [n["vfs"] for n in nodes]
    series = [("cython_best_ms", "extension", EXT), ("python_best_ms", "plain-Python twin", TWIN)]
    lo, hi = vfs[0] / 1.5, vfs[-1] * 1.5
    for key, label, color in series:
        pts = [(n["vfs"], n[key]) for n in nodes if n.get(key, 0) > 0]
        if not pts:
            continue
        ax.plot(*zip(*pts, strict=True), "o-", color=color, label=f"{label} (best of {doc['repeat']})")
        x0, y0 = pts[0]
        # Linear reference through the smallest node: a scan that stays on it costs the same per device.
        ax.plot([lo, hi], [y0 * lo / x0, y0 * hi / x0], "--", color=color, alpha=0.45, lw=1)
        for x, y in pts:
            ax.annotate(f"{y:.3g} ms", (x, y), textcoords="offset points", xytext=(6, -12), fontsize=8)
    ax.plot([], [], "--", color="grey", alpha=0.6, label="linear: time ∝ VFs, through the smallest node")
    ax.set_xscale("log", base=2)
    ax.set_xticks(vfs, [f"{v:,}" for v in vfs])
    ax.minorticks_off()
    _log_ms(ax)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("VFs on the node" + (" (with RDMA)" if doc.get("rdma") else ""))
    ax.set_ylabel("scan time (ms, log)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("sysfs scan time vs VF count")
    ratios = [f"{n['ratio']} at {n['vfs']:,} VFs" for n in nodes if "ratio" in n]
    caption = "Points above their dashed line grow faster than linearly."
    if ratios:
        caption += " Twin time over extension time: " + ", ".join(ratios) + "."
    if not doc.get("extension"):
        caption += " The extension was not built: only the twin is drawn."
    if len(nodes) == 1:
        caption += " One node size in this run (--quick); a full run measures 1,024, 4,096 and 16,384 VFs."
    if "linearity_16k_over_4k" in doc:
        caption += f" 16k/4k time ratio {doc['linearity_16k_over_4k']} (4.0 is linear)."
    return Drawn(_png(fig), caption)


def _e2e(records: list[Record]) -> list[Record]:
    return sorted(results(records, "bench_e2e"), key=lambda d: d["devices"])


def draw_cdf(records: list[Record]) -> Drawn | Missing:
    """PF down → kubelet latency, one cumulative distribution per node size (PF up dashed)."""
    docs = _e2e(records)
    if not docs:
        return absent(records, "bench_e2e", "PF down → kubelet latency")
    fig = _figure()
    ax = fig.add_subplot()
    colors = ["#1f6fb4", "#2a9d55", "#9b3fb5", "#c23b3b", "#8a6d1f"]
    summary_only = []
    for i, d in enumerate(docs):
        color = colors[i % len(colors)]
        label = f"{d['devices']:,} VFs, {d['pools']} pool{'s' if d['pools'] != 1 else ''}"
        if d.get("down_ms"):
            for key, style, what in (("down_ms", "-", "PF down"), ("up_ms", ":", "PF up")):
                xs = sorted(d.get(key) or [])
                if xs:
                    # From 0 at the fastest flip: the curve reads "this share of flips took at most x ms".
                    ys = [0.0] + [(k + 1) / len(xs) for k in range(len(xs))]
                    ax.step(
                        [xs[0], *xs],
                        ys,
                        style,
                        where="post",
                        color=color,
                        label=f"{what}, {label} ({len(xs)})",
                    )
        else:
            # A run recorded before the samples were kept: its percentiles are all there is.
            summary_only.append(d["devices"])
            pts = [(d["down_p50_ms"], 0.5), (d["down_p99_ms"], 0.99), (d["down_max_ms"], 1.0)]
            ax.plot(*zip(*pts, strict=True), "o--", color=color, label=f"PF down, {label} (p50/p99/max)")
    ax.axhline(0.99, color="grey", lw=0.8, alpha=0.5)
    ax.text(
        1.0, 0.99, "p99 ", transform=ax.get_yaxis_transform(), ha="right", va="top", fontsize=8, color="grey"
    )
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("ms from the link change to the kubelet holding the PF's VFs (Unhealthy / Healthy again)")
    ax.set_ylabel("fraction of flips")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("PF down → kubelet latency (cumulative)")
    d = docs[-1]
    caption = (
        f"Real veth links in a network namespace, the daemon as its own process, its coalescing window "
        f"included (hold-down {d['hold_down_s']:g} s). Largest node: p50 {d['down_p50_ms']} ms, p99 "
        f"{d['down_p99_ms']} ms, max {d['down_max_ms']} ms over {d['flips']} flips."
    )
    if summary_only:
        caption += f" Only percentiles were recorded for {', '.join(map(str, summary_only))} VFs."
    return Drawn(_png(fig), caption)


def _one_size_note(docs: list[Record]) -> str:
    if len({d["devices"] for d in docs}) > 1:
        return ""
    return (
        " One node size in this run: `bench/run_all.py --e2e-sizes 1024,4096,16384` (root) draws the trend."
    )


def draw_startup(records: list[Record]) -> Drawn | Missing:
    """Daemon start-up (and re-registration after a kubelet restart) against node size."""
    docs = _e2e(records)
    if not docs:
        return absent(records, "bench_e2e", "start-up vs node size")
    fig = _figure()
    ax = fig.add_subplot()
    sizes = [d["devices"] for d in docs]
    ax.plot(sizes, [d["startup_ms"] for d in docs], "o-", color=EXT, label="start → every pool listed")
    ax.plot(
        sizes,
        [d["kubelet_restart_to_all_registered_ms"] for d in docs],
        "s--",
        color="#2a9d55",
        label="kubelet restart → every pool registered again",
    )
    for d in docs:
        ax.annotate(f"{d['startup_ms']:.0f} ms", (d["devices"], d["startup_ms"]), xytext=(6, 4),
                    textcoords="offset points", fontsize=8)  # fmt: skip
    _size_axis(ax, sizes)
    _headroom(ax, [d["startup_ms"] for d in docs] + [d["kubelet_restart_to_all_registered_ms"] for d in docs])
    ax.set_ylabel("ms")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("start-up vs node size")
    caption = (
        "`densedev run` as a process: imports, scan, pools, servers and registration until the kubelet "
        "emulator holds every pool's full list." + _one_size_note(docs)
    )
    return Drawn(_png(fig), caption)


def draw_idle(records: list[Record]) -> Drawn | Missing:
    """The idle daemon's CPU share and resident memory against node size."""
    docs = _e2e(records)
    if not docs:
        return absent(records, "bench_e2e", "idle CPU and memory vs node size")
    fig = _figure(width=9.0, height=3.8)
    cpu_ax, rss_ax = fig.subplots(1, 2)
    sizes = [d["devices"] for d in docs]
    cpu_ax.plot(sizes, [d["idle_cpu_percent"] for d in docs], "o-", color=EXT)
    cpu_ax.set_ylabel("% of one core")
    cpu_ax.set_title(f"idle CPU over {docs[-1]['idle_s']:g} s", fontsize=10)
    rss_ax.plot(
        sizes, [d["daemon_rss_after_flips_mib"] for d in docs], "o-", color=EXT, label="after the flips"
    )
    rss_ax.plot(
        sizes,
        [d["daemon_rss_after_idle_mib"] for d in docs],
        "s--",
        color=TWIN,
        mfc="none",
        label="after idling",
    )
    rss_ax.set_ylabel("resident memory (MiB)")
    rss_ax.set_title("daemon RSS", fontsize=10)
    rss_ax.legend(fontsize=8, loc="upper left")
    _headroom(cpu_ax, [d["idle_cpu_percent"] for d in docs])
    _headroom(
        rss_ax,
        [d["daemon_rss_after_flips_mib"] for d in docs] + [d["daemon_rss_after_idle_mib"] for d in docs],
    )
    for ax in (cpu_ax, rss_ax):
        _size_axis(ax, sizes)
        ax.grid(True, alpha=0.3)
    fig.suptitle("idle CPU and memory vs node size")
    caption = (
        f"Nothing changes while idle: only the daemon's timers run. A full reconcile comes every 60 s by "
        f"default, so the {docs[-1]['idle_s']:g} s window here "
        + ("holds about one." if docs[-1]["idle_s"] >= 60 else "may hold none (a full run idles 60 s).")
        + _one_size_note(docs)
    )
    return Drawn(_png(fig), caption)


def draw_preferred(records: list[Record]) -> Drawn | Missing:
    """GetPreferredAllocation latency per policy and request size, extension and twin, p50 and p99."""
    docs = [d for d in results(records, "bench_preferred") if d.get("results")]
    if not docs:
        return absent(records, "bench_preferred", "preferred-allocation latency")
    doc = docs[-1]
    rows = doc["results"]
    fig = _figure(width=9.0, height=4.2)
    ax = fig.add_subplot()
    labels = [f"{r['policy']} {r['size']}" + (" +pin" if r["must_include"] else "") for r in rows]
    xs = list(range(len(rows)))
    width = 0.38
    for offset, key, label, color in (
        (-width / 2, "cython", "extension", EXT),
        (width / 2, "python", "twin", TWIN),
    ):
        have = [(x + offset, r[key]) for x, r in zip(xs, rows, strict=True) if r.get(key)]
        if not have:
            continue
        ax.bar([x for x, _ in have], [v["p99_ms"] for _, v in have], width, color=color, alpha=0.8,
               label=f"{label} p99")  # fmt: skip
        ax.plot([x for x, _ in have], [v["p50_ms"] for _, v in have], "_", color="black", ms=14, mew=2)
    ax.plot([], [], "_", color="black", ms=14, mew=2, label="p50")
    _log_ms(ax)
    ax.set_xticks(xs, labels, rotation=30, ha="right", fontsize=8)
    ax.set_xlabel("policy and devices requested (+pin: one device the kubelet must include)")
    ax.set_ylabel("ms per call (log)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over them
    fig.suptitle(f"GetPreferredAllocation latency, {doc['available']:,} devices available")
    worst = max((r["cython"]["p99_ms"] for r in rows if r.get("cython")), default=None)
    caption = "Each call ranks the whole available list, as the kubelet sends it."
    if worst is not None:
        caption += f" Worst extension p99: {worst:.2f} ms (target ≤ 2 ms)."
    return Drawn(_png(fig), caption)


PLOTS = (
    Plot("scan", "sysfs scan time vs VF count", draw_scan),
    Plot("e2e_cdf", "PF down → kubelet latency distribution", draw_cdf),
    Plot("startup", "start-up vs node size", draw_startup),
    Plot("idle", "idle CPU and RSS vs node size", draw_idle),
    Plot("preferred", "preferred-allocation latency", draw_preferred),
)

CSS = """
body{font:15px/1.45 system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em;margin-bottom:.2em} h2{font-size:1.15em;margin:1.6em 0 .4em;border-bottom:1px solid #ddd}
.meta{color:#555;margin-top:0} img{max-width:100%;height:auto;border:1px solid #eee}
.missing{background:#fff6e0;border-left:4px solid #e0a800;padding:.6em .8em}
figcaption{color:#444;font-size:.92em;margin-top:.3em} figure{margin:0}
table{border-collapse:collapse;font-size:.85em}
td,th{border-bottom:1px solid #eee;padding:.2em .6em;text-align:left}
code{background:#f4f4f4;padding:0 .2em} nav a{margin-right:1em}
"""


def _prose(text: str) -> str:
    """Caption text as HTML: escaped, with `backticked` commands set as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _run_info(records: list[Record]) -> Record:
    return next((r["run"] for r in records if "run" in r), {})


def _scripts_table(records: list[Record]) -> str:
    seen: dict[tuple[str, str], Record] = {}
    for r in records:
        if "script" in r:
            seen.setdefault((r["script"], " ".join(r.get("args", []))), r)
    rows = []
    for (script, args), r in seen.items():
        status = "ok" if r["exit"] == 0 else f"exit {r['exit']}"
        what = r.get("banner") or r.get("note") or ""
        rows.append(
            f"<tr><td><code>{html.escape(script)}</code> {html.escape(args)}</td><td>{status}</td>"
            f"<td>{r['seconds']} s</td><td>{html.escape(what)}</td></tr>"
        )
    return (
        "<table><tr><th>script</th><th>status</th><th>time</th><th>measured</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def build(records: list[Record], out: Path, source: str = "") -> Path:
    """Draw every plot the records allow into ``out`` (PNGs and index.html); return the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.png"):  # a plot this run cannot draw must not survive from an earlier one
        stale.unlink()
    info = _run_info(records)
    sections = []
    for plot in PLOTS:
        try:
            outcome = plot.draw(records)
        except (KeyError, TypeError, ValueError) as e:  # a record of another shape: say so, draw the rest
            outcome = Missing(f"{plot.title}: the run's figures have an unexpected shape ({e!r}).")
        if isinstance(outcome, Drawn):
            (out / f"{plot.name}.png").write_bytes(outcome.png)
            data = base64.b64encode(outcome.png).decode()
            body = (
                f'<figure><img src="data:image/png;base64,{data}" data-file="{plot.name}.png" '
                f'alt="{html.escape(plot.title)}"><figcaption>{_prose(outcome.caption)} '
                f'<a href="{plot.name}.png">{plot.name}.png</a></figcaption></figure>'
            )
        else:
            body = f'<p class="missing">{_prose(outcome.reason)}</p>'
        sections.append(f'<section id="{plot.name}"><h2>{html.escape(plot.title)}</h2>{body}</section>')
    nav = "".join(f'<a href="#{p.name}">{html.escape(p.title)}</a>' for p in PLOTS)
    impl = "plain-Python twin (DENSEDEV_NO_EXTENSIONS=1)" if info.get("no_extensions") else "Cython extension"
    meta = (
        f"{html.escape(str(info.get('started', '?')))} · {html.escape(str(info.get('host', '?')))}, "
        f"{info.get('cpus', '?')} CPUs, Python {html.escape(str(info.get('python', '?')))} · "
        f"{'quick (smoke sizes)' if info.get('quick') else 'full sizes'} · measuring the {impl} · "
        f"<code>bench/run_all.py {html.escape(' '.join(info.get('argv', [])))}</code>"
        + (f" · figures: <code>bench/results/{html.escape(source)}</code>" if source else "")
    )
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>densedev benchmarks</title><style>{CSS}</style></head><body>"
        f'<h1>densedev benchmarks</h1><p class="meta">{meta}</p><nav>{nav}</nav>'
        + "".join(sections)
        + "<h2>scripts in this run</h2>"
        + _scripts_table(records)
        + "</body></html>\n"
    )
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


class _Page(HTMLParser):
    """The sections of a report page, the images each embeds and the files it links."""

    def __init__(self) -> None:
        super().__init__()
        self.section = ""
        self.sections: dict[str, dict[str, Any]] = {}
        self.links: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "section":
            self.section = a.get("id", "")
            self.sections[self.section] = {"images": [], "missing": False}
        elif tag == "img" and self.section:
            self.sections[self.section]["images"].append((a.get("data-file", ""), a.get("src", "")))
        elif tag == "p" and self.section and "missing" in a.get("class", "").split():
            self.sections[self.section]["missing"] = True
        elif tag == "a" and a.get("href", "").endswith(".png"):
            self.links.add(a["href"])


def check(out: Path) -> list[str]:
    """Problems of the report in ``out``: every plot a file beside the page, embedded and linked by it,
    every section a plot or a stated reason; an empty list when the report is whole."""
    page = out / "index.html"
    if not page.is_file():
        return [f"{page}: missing"]
    parser = _Page()
    parser.feed(page.read_text(encoding="utf-8"))
    problems: list[str] = []
    embedded: set[str] = set()
    for plot in PLOTS:
        sec = parser.sections.get(plot.name)
        if sec is None:
            problems.append(f"section {plot.name!r} missing from the page")
            continue
        if not sec["images"] and not sec["missing"]:
            problems.append(f"section {plot.name!r}: neither a plot nor a reason for its absence")
        for name, src in sec["images"]:
            embedded.add(name)
            file = out / name
            if not file.is_file():
                problems.append(f"{name}: referenced by the page, not in {out}")
                continue
            data = file.read_bytes()
            if not data.startswith(PNG_MAGIC):
                problems.append(f"{name}: not a PNG")
            prefix = "data:image/png;base64,"
            if not src.startswith(prefix) or base64.b64decode(src[len(prefix) :]) != data:
                problems.append(f"{name}: the page embeds another image than the file")
            if name not in parser.links:
                problems.append(f"{name}: not linked from the page")
    for file in sorted(out.glob("*.png")):
        if file.name not in embedded:
            problems.append(f"{file.name}: in {out} but not on the page")
    return problems


def load(path: Path) -> list[Record]:
    """The records of a bench/run_all.py JSONL file."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main() -> int:
    """Draw a recorded run, or check a drawn report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="?", type=Path, help="a bench/results/*.jsonl file of bench/run_all.py")
    p.add_argument("out", nargs="?", type=Path, help="the directory to write index.html and the PNGs to")
    p.add_argument("--check", type=Path, metavar="DIR", help="check the report in DIR instead")
    args = p.parse_args()
    if args.check is not None:
        problems = check(args.check)
        for problem in problems:
            print(f"report.py: {problem}", file=sys.stderr)
        if not problems:
            print(f"report in {args.check}: every plot is a file, embedded and linked; every section present")
        return 1 if problems else 0
    if args.results is None or args.out is None:
        p.error("give RESULTS.jsonl and DIR, or --check DIR")
    missing = matplotlib_missing()
    if missing:
        print(f"report.py: {missing}", file=sys.stderr)
        return 2
    try:
        records = load(args.results)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        print(f"report.py: cannot read {args.results}: {e}", file=sys.stderr)
        return 1
    print(f"report in {build(records, args.out, source=args.results.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
