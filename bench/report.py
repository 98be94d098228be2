"""The table: figures, the references measured in the same run, the target ratios, PASS/MISS."""

from __future__ import annotations

import math
from typing import Any

Row = tuple[str, str, str]  # what, figure, verdict/note


def _n(x: float | None, fmt: str = ",.0f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, fmt)


def _ms(x: float | None) -> str:
    return "n/a" if x is None else (f"{x:.2f} ms" if x < 10 else f"{x:.1f} ms")


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def build(res: dict[str, Any]) -> tuple[list[tuple[str, list[Row]]], list[dict[str, Any]]]:
    """Sections of rows, and the target verdicts (also stored in the JSON)."""
    sections: list[tuple[str, list[Row]]] = []
    targets: list[dict[str, Any]] = []

    def target(
        name: str,
        figure: float | None,
        reference: float | None,
        ratio_needed: float | None,
        ok: bool | None,
        detail: str,
    ) -> None:
        targets.append(
            {
                "target": name,
                "figure": figure,
                "reference": reference,
                "needed": ratio_needed,
                "ok": ok,
                "detail": detail,
            }
        )

    med = res.get("medians", {})
    drains = med.get("drain", {})
    runs = res.get("args", {}).get("runs", 1)
    mtxt = f"median of {runs}" if runs > 1 else "1 run"

    def best(system: str, workload: str) -> tuple[str | None, float | None]:
        cands = [(k, v["jobs_per_s"]) for k, v in drains.items() if v["system"] == system and v["workload"] == workload]
        cands = [c for c in cands if c[1]]
        return max(cands, key=lambda c: c[1]) if cands else (None, None)

    # ---------------------------------------------------------------- throughput
    for workload, title in (("noop", "No-op throughput"), ("write", "Idempotent-write throughput")):
        rows: list[Row] = []
        for key, v in drains.items():
            if v["workload"] != workload:
                continue
            note = (
                f"{v['jobs']:,} jobs; enqueue {_n(v['enqueue_per_s'])}/s; "
                f"{_n(v['commits_per_job'], '.2f')} commits/job; "
                f"worker CPU {_n(v['worker_cpu_ms_per_job'], '.2f')} ms/job"
            )
            if v.get("problems"):
                note += "; PROBLEMS: " + "; ".join(v["problems"])
            rows.append((f"{key}", f"{_n(v['jobs_per_s'])} jobs/s", note))
        if rows:
            sections.append((f"{title} ({mtxt}; jobs/s from first job started to last settled)", rows))

    pgb = med.get("pgbench", {})
    if pgb:
        sections.append(
            (
                f"pgbench ceiling ({mtxt})",
                [
                    (f"pgbench {k.replace(':', ', ')} clients", f"{_n(v)} tx/s", "")
                    for k, v in sorted(pgb.items(), key=lambda kv: (kv[0].split(":")[0] != "update", kv[0]))
                ],
            )
        )

    qc_noop_key, qc_noop = best("qconsole", "noop")
    pq_noop_key, pq_noop = best("pgqueuer", "noop")
    pr_noop_key, pr_noop = best("procrastinate", "noop")
    qc_write_key, qc_write = best("qconsole", "write")
    upd8 = pgb.get("update:8")
    if qc_noop is not None and pq_noop:
        r = qc_noop / pq_noop
        target(
            "no-op jobs/s >= 1.5x pgqueuer best",
            qc_noop,
            pq_noop,
            1.5,
            r >= 1.5,
            f"{qc_noop_key} {qc_noop:,.0f} vs {pq_noop_key} {pq_noop:,.0f}: {r:.2f}x",
        )
    if qc_noop is not None and pr_noop:
        r = qc_noop / pr_noop
        target(
            "no-op jobs/s >= 10x procrastinate",
            qc_noop,
            pr_noop,
            10.0,
            r >= 10,
            f"{qc_noop_key} {qc_noop:,.0f} vs {pr_noop_key} {pr_noop:,.0f}: {r:.2f}x",
        )
    if qc_write is not None and upd8:
        r = qc_write / upd8
        target(
            "idempotent-write jobs/s >= 1.0x pgbench single-row UPDATE @ 8 clients",
            qc_write,
            upd8,
            1.0,
            r >= 1.0,
            f"{qc_write_key} {qc_write:,.0f} vs {upd8:,.0f} tx/s: {r:.2f}x",
        )

    # ---------------------------------------------------------------- pickup
    pick = med.get("pickup", {})
    if pick:
        rows = [
            (
                f"pickup latency {s}",
                f"p50 {_ms(v.get('p50_ms'))} / p99 {_ms(v.get('p99_ms'))}",
                f"{v.get('jobs')} jobs 50 ms apart, idle worker",
            )
            for s, v in pick.items()
        ]
        sections.append((f"Pickup latency, enqueue commit -> handler start ({mtxt})", rows))
        q, p = pick.get("qconsole", {}).get("p50_ms"), pick.get("pgqueuer", {}).get("p50_ms")
        if q is not None and p is not None:
            target("pickup p50 <= pgqueuer's", q, p, 1.0, q <= p, f"{q:.2f} ms vs {p:.2f} ms: {q / p:.2f}x")

    # ---------------------------------------------------------------- big table
    big = res.get("bigtable")
    if big and "claim_stale" in big:
        n = big["finished"]
        rows = []
        for phase, label in (("claim_stale", "statistics as autovacuum leaves them"), ("claim_fresh", "after ANALYZE")):
            c = big[phase]
            rows.append(
                (
                    f"claim statement, limit 1, {label}",
                    f"p50 {_ms(c['statement_p50_ms'])} / p99 {_ms(c['statement_p99_ms'])}",
                    f"Worker.claim (filters, claim) p50 {_ms(c['worker_claim_p50_ms'])} / p99 "
                    f"{_ms(c['worker_claim_p99_ms'])}"
                    + ("; the plan sorts the whole backlog" if c.get("plan_sorts_backlog") else ""),
                )
            )
            if "batch_p50_ms" in c:
                rows.append(
                    (
                        f"claim statement, limit {c['batch']} (the worker's batch), {label}",
                        f"p50 {_ms(c['batch_p50_ms'])} / p99 {_ms(c['batch_p99_ms'])}",
                        f"{c['batch_claims']} claims"
                        + ("; the plan sorts the whole backlog" if c.get("batch_plan_sorts_backlog") else ""),
                    )
                )
        sections.append(
            (
                f"Claim latency, {n:,} finished rows + {big['waiting']:,} ready "
                f"({big['claim_fresh']['claims']} claims)",
                rows,
            )
        )
        worst = max(big["claim_stale"]["statement_p50_ms"], big["claim_fresh"]["statement_p50_ms"])
        target(
            "claim p50 < 0.5 ms at 1M rows (worse of the two statistics states)",
            worst,
            0.5,
            None,
            worst < 0.5,
            f"stale {big['claim_stale']['statement_p50_ms']:.2f} ms, "
            f"fresh {big['claim_fresh']['statement_p50_ms']:.2f} ms"
            + ("" if n >= 1_000_000 else f" (on {n:,} rows only: --quick)"),
        )

        rows = []
        for phase, label in (("console_stale", "stale statistics"), ("console_fresh", "after ANALYZE")):
            c = big[phase]
            f = c["functions"]
            for fname, v in f.items():
                scans = "; reads the finished rows" if v["reads_finished_rows"] else ""
                slow = sorted(v["statements"], key=lambda s: -s["db_ms"])[0]
                rows.append(
                    (
                        f"{fname} ({label})",
                        f"{v['db_ms']:.1f} ms DB",
                        f"wall {v['wall_ms_median']:.1f} ms; slowest: {slow['name']} {slow['db_ms']:.1f} ms{scans}",
                    )
                )
            rows.append(
                (f"console total ({label})", f"{c['total_db_ms']:.1f} ms DB", f"wall {c['total_wall_ms']:.1f} ms")
            )
        cons = big.get("console") or {}
        if cons.get("skipped"):
            rows.append(("console process", "skipped", cons["skipped"]))
        else:
            rows.append(
                (
                    "console first frame (80x24 pty)",
                    f"{_n(cons.get('first_frame_s'), '.2f')} s",
                    f"first data {_n(cons.get('first_data_s'), '.2f')} s",
                )
            )
            rows.append(
                (
                    "console resident memory",
                    f"{_n(cons.get('rss_mb'), '.0f')} MB",
                    f"peak {_n(cons.get('peak_rss_mb'), '.0f')} MB",
                )
            )
        sections.append(
            (f"Console cost on {n:,} finished + {big['dead_lettered']:,} dead + {big['waiting']:,} waiting", rows)
        )
        ov = max(big["console_stale"]["overview_db_ms"], big["console_fresh"]["overview_db_ms"])
        tot = max(big["console_stale"]["total_db_ms"], big["console_fresh"]["total_db_ms"])
        target(
            "overview refresh < 50 ms DB time (issue 5)", ov, 50.0, None, ov < 50, f"{ov:.1f} ms (worse of stale/fresh)"
        )
        target(
            "overview + list_jobs + dead_letter_groups < 50 ms DB time",
            tot,
            50.0,
            None,
            tot < 50,
            f"{tot:.1f} ms (worse of stale/fresh)",
        )
        if not cons.get("skipped"):
            rss, ff = cons.get("rss_mb"), cons.get("first_frame_s")
            target(
                "console < 150 MB resident",
                rss,
                150.0,
                None,
                None if rss is None else rss < 150,
                f"{_n(rss, '.0f')} MB",
            )
            target("console first frame < 1.5 s", ff, 1.5, None, None if ff is None else ff < 1.5, f"{_n(ff, '.2f')} s")
    return sections, targets


def render(res: dict[str, Any]) -> str:
    sections, targets = build(res)
    res["targets"] = targets
    m, s = res.get("machine", {}), res.get("server", {})
    lines = [
        f"qconsole bench — {m.get('date', '?')} — {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
        f"{m.get('ram_gb', '?')} GB; git {m.get('git', '?')}",
        f"server: PostgreSQL {s.get('version', '?')} ({s.get('kind', '?')}), "
        + ", ".join(f"{k}={v}" for k, v in (s.get("settings") or {}).items()),
        f"mode: {'quick' if res.get('args', {}).get('quick') else 'full'}; load average at start "
        f"{res.get('load_start')} / end {res.get('load_end')}",
    ]
    if res.get("busy_start"):
        lines.append("other busy processes at start: " + "; ".join(res["busy_start"][:5]))
    lines.append("")
    w1 = max([len(r[0]) for _, rows in sections for r in rows] + [30])
    w2 = max([len(r[1]) for _, rows in sections for r in rows] + [12])
    for title, rows in sections:
        lines.append(f"## {title}")
        lines.append(f"| {'what'.ljust(w1)} | {'figure'.ljust(w2)} | notes")
        lines.append(f"|{'-' * (w1 + 2)}|{'-' * (w2 + 2)}|------")
        for what, fig, note in rows:
            lines.append(f"| {what.ljust(w1)} | {fig.ljust(w2)} | {note}")
        lines.append("")
    lines.append("## Targets (ratios in the same run)")
    wt = max([len(t["target"]) for t in targets] + [20])
    lines.append(f"| {'target'.ljust(wt)} | verdict | figure")
    lines.append(f"|{'-' * (wt + 2)}|---------|-------")
    for t in targets:
        lines.append(f"| {t['target'].ljust(wt)} | {_verdict(t['ok']).ljust(7)} | {t['detail']}")
    for note in res.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"
