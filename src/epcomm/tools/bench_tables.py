"""``epcomm bench``'s tables (and its PNG): what each rank measured, as text. The figures are
bench.py's (host / gpu / synced seconds per call, as docs/PERFORMANCE.md defines them); these
functions only lay them out, rank 0's table first, then every rank's figures where a call runs at
its slowest rank's pace."""
from __future__ import annotations

from typing import Dict, List


def _rank0_table(title: str, rows: List[Dict], systems: List[str]) -> str:
    """call | per system host/gpu/synced | epcomm ÷ the second system (the peer, or nvlink beside
    virtual nodes) per figure."""
    lines = [title, "# µs, rank 0; host / gpu / synced (docs/PERFORMANCE.md)"]
    header = f"{'call':<28}" + "".join(f" {s + ' h/g/s':>24}" for s in systems)
    other = next((s for s in ("deep_ep", "nvlink") if s in systems), None)
    if other:
        header += f" {'epcomm÷' + other + ' h/g/s':>22}"
    lines.append(header)
    for row in rows:
        line = f"{row['call']:<28}"
        for s in systems:
            f = row.get(s)
            line += f" {'-':>24}" if f is None else f" {f['host'] * 1e6:7.0f} /{f['gpu'] * 1e6:7.0f} /{f['synced'] * 1e6:6.0f}"
        if other:
            e, d = row.get("epcomm"), row.get(other)
            line += f" {'-':>22}" if not (e and d) else \
                f" {e['host'] / d['host']:6.2f} /{e['gpu'] / d['gpu']:6.2f} /{e['synced'] / d['synced']:6.2f}"
        lines.append(line)
    return "\n".join(lines)


def with_every_rank(results: List[Dict]) -> Dict:
    """Rank 0's result, each point given ``every_rank``: ``{call: {system: [gpu µs, synced µs] of
    each rank}}`` — a slow rank sets a collective call's pace, and rank 0 need not be it."""
    result = results[0]
    for i, point in enumerate(result["points"]):
        point["every_rank"] = {
            row["call"]: {system: [[round(rank["points"][i]["rows"][j][system][kind] * 1e6, 1) for rank in results]
                                   for kind in ("gpu", "synced")]
                          for system in row if system != "call"}
            for j, row in enumerate(point["rows"])}
    return result


def _every_rank_lines(point: Dict) -> List[str]:
    """One line per call: each system's gpu and synced µs on every rank (the slowest marked)."""
    lines = ["# every rank, µs: gpu r0 r1 ... | synced r0 r1 ... (* the slowest)"]
    for call, systems in point.get("every_rank", {}).items():
        parts = []
        for system, (gpu, synced) in systems.items():
            marked = [" ".join(f"{v:.0f}" + ("*" if i == values.index(max(values)) and min(values) < v else "")
                               for i, v in enumerate(values)) for values in (gpu, synced)]
            parts.append(f"{system} {marked[0]} | {marked[1]}")
        lines.append(f"{call:<28} " + "; ".join(parts))
    return lines if len(lines) > 1 else []


def normal_table(result: Dict) -> str:
    s = result["settings"]
    systems = ["epcomm"] + ([result["peer"]] if result["peer"] else []) + ["nccl"]
    blocks = []
    for point in result["points"]:
        title = (f"# epcomm bench normal: {result['world']} x {result['device']}, backend {result['backend']}, "
                 f"T={point['tokens']} H={s['hidden']} K={s['num_topk']} E={s['num_experts']} "
                 f"Config({point.get('sms', s['sms'])}, 8, 256); "
                 + (f"{result['peer']}: its recommended configs; "
                    if result["peer"] and s.get("peer_configs") == "recommended" else "")
                 + (f"send_parts {point['send_parts']}, p2p {int(point['p2p'])}; " if point.get("send_parts") else "")
                 + (f"variant {point['variant']}; " if point.get("variant") else "")
                 + f"rank 0 receives {point['recv_tokens']} rows")
        blocks.append(_rank0_table(title, point["rows"], systems))
        blocks.append("checks: " + ", ".join(f"{k} {'OK' if v else 'MISMATCH'}" for k, v in point["checks"].items()))
        blocks.extend(_every_rank_lines(point))
        if "inter_node" in point:
            n = point["inter_node"]
            blocks.append(f"inter-node (rank 0, BF16 dispatch): {n['rows']} rows = {n['bytes'] / 1e6:.2f} MB; minimum "
                          f"{n['min_rows']} rows = {n['min_bytes'] / 1e6:.2f} MB (one per token and other node)")
        rows = {r["call"]: r for r in point["rows"]}
        full = rows["dispatch, full, BF16"]
        if "nccl" in full:
            blocks.append(f"full dispatch vs NCCL baseline (synced): {full['nccl']['synced'] / full['epcomm']['synced']:.2f}x "
                          f"faster")
    return "\n".join(blocks)


def plot_normal(result: Dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    point = result["points"][0]
    systems = ["epcomm"] + ([result["peer"]] if result["peer"] else []) + ["nccl"]
    calls = [r["call"] for r in point["rows"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        values = [r[system]["synced"] * 1e6 if system in r else 0 for r in point["rows"]]
        ax.bar([c + i * width for c in range(len(calls))], values, width, label=system)
    ax.set_xticks([c + width * (len(systems) - 1) / 2 for c in range(len(calls))])
    ax.set_xticklabels(calls, rotation=15, fontsize=8)
    ax.set_ylabel("synced µs (rank 0)")
    ax.set_title(f"{result['world']} x {result['device']}, T={point['tokens']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def low_latency_table(result: Dict) -> str:
    s = result["settings"]
    # every experiment's column ("epcomm <name>", LowLatencyBenchSettings), in the run's order
    variants = [name for name in result["kernels_us_per_round_trip"] if name.startswith("epcomm ")]
    systems = ["epcomm"] + variants + ([result["peer"]] if result["peer"] else []) + ["nccl"]
    nodes = f", virtual nodes of {s['ranks_per_node']} rank(s)" if s.get("ranks_per_node") else ""
    title = (f"# epcomm bench low-latency: {result['world']} x {result['device']}, backend {result['backend']}{nodes}, "
             f"T={s['tokens']} H={s['hidden']} K={s['num_topk']} E={s['num_experts']} (FP8 dispatch, BF16 combine)")
    lines = [_rank0_table(title, result["rows"], systems),
             "checks: " + ", ".join(f"{k} {'OK' if v else 'FAILED'}" for k, v in result["checks"].items())]
    graph = next((r for r in result["rows"] if r["call"] == "round trip, one CUDA graph"), {})
    if s.get("ranks_per_node") and graph.get("epcomm") and graph.get("nvlink"):
        ratio = graph["epcomm"]["synced"] / graph["nvlink"]["synced"]
        lines.append(f"target: round trip in a graph on virtual nodes <= 2x one node: {ratio:.2f}x "
                     f"({'met' if ratio <= 2 else 'missed'})")
    loop = result.get("decode_loop", {})
    if loop:
        shown = "; ".join(f"{name} median {t['median'] * 1e6:.1f} p99 {t['p99'] * 1e6:.1f}" for name, t in loop.items())
        lines.append(f"decode loop (barrier; dispatch + combine; sync), wall µs, rank 0, "
                     f"{s.get('decode_pairs', 100)} pairs: {shown}")
        if "epcomm" in loop and result["peer"] in loop:
            lines.append(f"decode loop epcomm / {result['peer']} (median): "
                         f"{loop['epcomm']['median'] / loop[result['peer']]['median']:.2f}x")
    for name, kernels in result["kernels_us_per_round_trip"].items():
        lines.append(f"{name} kernels per round trip (µs, rank 0): " + ", ".join(f"{k} {us}" for us, k in kernels))
    return "\n".join(lines)
