"""Break the code on purpose, one small realistic change at a time, and check a test notices.

Each mutation below is a text patch located by a short pattern anywhere under ``proxy/``
(so it survives files being moved or split); it is applied to a temporary copy of the
working tree, and the tests that guard the property run there. A mutation is *caught* when
those tests fail, *missed* when they pass. A pattern that matches nothing (or more than one
place) is reported as such and skipped: the code moved on, the pattern needs updating.

Rows with no patch are properties today's code does not have yet: their guard is an
``xfail(strict=True)`` test, run here with ``--runxfail``, and "caught" means it fails today.

    python tests/mutations/run.py              # every mutation, a table at the end
    python tests/mutations/run.py --list
    python tests/mutations/run.py --only admission --baseline

(Not collected by pytest: the file is not named ``test_*.py``.)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    guards: tuple[str, ...]
    #: regex (MULTILINE) that must match exactly once in proxy/**/*.py; None: no patch (xfail row)
    pattern: str | None = None
    replacement: str = ""


POLICY_PROPERTIES = (
    "tests/test_policy.py::test_every_ranked_node_is_eligible_and_kvroute_ranks_only_fitting_nodes",
    "tests/test_policy.py::test_kvroute_ranks_exactly_the_nodes_that_hold_the_request_at_the_edge",
)

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "leak-whole-answer",
        "no release after a successful non-streamed answer",
        (
            "tests/test_fuzz.py::test_fuzz_left_no_reservation",
            "tests/test_gateway_e2e.py::test_redis_store_used_by_gateway_leaves_no_reservations",
            "tests/faults/test_fault_suite.py::test_fault_baseline",
        ),
        r"^(\s*)self\._spawn\(self\.ledger\.release\(backend, rid\)\)(\s*# off the answer's path.*)$",
        r"\1pass  # MUTATION\2",
    ),
    Mutation(
        "leak-stream-close",
        "no release when a stream closes",
        (
            "tests/test_fuzz.py::test_fuzz_left_no_reservation",
            "tests/test_gateway_e2e.py::test_redis_store_used_by_gateway_leaves_no_reservations",
            "tests/faults/test_fault_suite.py::test_fault_baseline",
        ),
        r"(observe\(time\.perf_counter\(\) - t_start\)\n\s*)self\._spawn\(self\.ledger\.release\(backend, rid\)\)",
        r"\1pass  # MUTATION",
    ),
    Mutation(
        "release-not-queued",
        "a failed release is not queued for retry",
        ("tests/faults/test_fault_suite.py::test_fault_redis_paused",),
        r"self\.pending\[rid\] = \(backend, self\.clock\(\) \+ self\.ttl_s\)",
        "pass  # MUTATION",
    ),
    Mutation(
        "degraded-ignores-pools",
        "Redis down: length-only routing ignores the long pool",
        (
            "tests/faults/test_fault_placement.py::test_long_requests_still_go_to_the_long_pool_while_redis_is_down",
        ),
        r"unknown\.sort\(key=lambda n: \(n\.role != want, ",
        "unknown.sort(key=lambda n: (",
    ),
    Mutation(
        "degraded-pinned",
        "Redis down: every request to the first backend (today's code; xfail until issue 9)",
        ("tests/faults/test_fault_placement.py::test_placement_while_redis_is_down_is_spread",),
    ),
    Mutation(
        "classify-503",
        "capacity phrases matched only on 500/507, not 503",
        ("tests/test_classify.py",),
        r"if status in \(500, 503, 507\) and",
        "if status in (500, 507) and",
    ),
    Mutation(
        "classify-case",
        "capacity phrases matched without case folding",
        ("tests/test_classify.py",),
        r"lowered = body\[:4096\]\.lower\(\)",
        "lowered = body[:4096]",
    ),
    Mutation(
        "classify-424",
        "TGI's 424 generation errors not read (today's code; xfail rows)",
        ("tests/test_classify.py::test_real_servers_errors_are_classified",),
    ),
    Mutation(
        "admission-deadline",
        "the queue waits 10 x queue.max_wait_s",
        ("tests/test_admission.py::test_queued_request_gets_503_after_max_wait_not_much_later",),
        r"queue_deadline = time\.monotonic\(\) \+ self\.cfg\.queue\.max_wait_s",
        "queue_deadline = time.monotonic() + 10 * self.cfg.queue.max_wait_s",
    ),
    Mutation(
        "admission-unbounded",
        "queue.max_size ignored",
        (
            "tests/test_admission.py::test_full_queue_answers_503_at_once_and_a_waiter_gets_through_when_memory_frees",
        ),
        r"if self\.depth >= self\.max_size:",
        "if False:  # MUTATION",
    ),
    Mutation(
        "advice-tie",
        "a tie of one capacity and one fragmentation failure goes to restart",
        ("tests/test_advice.py",),
        r"if current and len\(current\) >= len\(current_fixable\):",
        "if current and len(current) > len(current_fixable):",
    ),
    Mutation(
        "advice-block-size",
        "'still fragmented' ignores block size (today's code; xfail)",
        ("tests/test_advice.py::test_still_fragmented_counts_whole_blocks",),
    ),
    Mutation(
        "vllm-dp-override",
        "data-parallel vLLM capacity override not divided per engine",
        ("tests/test_collector.py",),
        r"engine_capacity = capacity_override // len\(usage\)",
        "engine_capacity = capacity_override",
    ),
    Mutation(
        "vllm-usage-as-free",
        "vLLM usage read as the free share",
        ("tests/test_collector.py",),
        r"engine_free = round\(\(1\.0 - u\) \* num_blocks\) \* block_size",
        "engine_free = round(u * num_blocks) * block_size",
    ),
    Mutation(
        "fit-ignores-margin",
        "NodeView.fits ignores the safety margin (the property test's old oracle was fits itself)",
        POLICY_PROPERTIES,
        r"need = demand \* \(1\.0 \+ safety_margin\)",
        "need = float(demand)",
    ),
    Mutation(
        "fit-ignores-blocks",
        "NodeView.fits ignores whole blocks on a paged allocator",
        POLICY_PROPERTIES,
        r"need = -\(-int\(need\) // bs\) \* bs",
        "pass  # MUTATION",
    ),
    Mutation(
        "fit-ceiling-off-by-one",
        "a learned ceiling refuses only sizes above it, not the size that failed",
        POLICY_PROPERTIES,
        r"demand >= \(self\.overlay\.ceiling_tokens or 0\)",
        "demand > (self.overlay.ceiling_tokens or 0)",
    ),
    Mutation(
        "log-authorization",
        "the request's headers (Authorization too) logged",
        ("tests/test_logs.py",),
        r"^(\s*)(client_rid = request\.headers\.get\(\"x-request-id\"\) or rid)$",
        r'\1\2\n\1log.warning("request headers %s", dict(request.headers))',
    ),
)


def tree_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files: what the tests would see in a checkout."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return [p for p in out.split("\0") if p]


def copy_tree(root: Path, dest: Path) -> None:
    for rel in tree_files(root):
        src = root / rel
        if not src.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def apply(m: Mutation, tree: Path) -> str | None:
    """Patch the copy; None when applied, else why not."""
    assert m.pattern is not None
    rx = re.compile(m.pattern, re.MULTILINE)
    hits = [(p, len(rx.findall(p.read_text()))) for p in sorted((tree / "proxy").rglob("*.py"))]
    hits = [(p, n) for p, n in hits if n]
    if not hits:
        return "pattern not found"
    if len(hits) > 1 or hits[0][1] > 1:
        where = ", ".join(f"{p.relative_to(tree)} x{n}" for p, n in hits)
        return f"pattern ambiguous ({where})"
    path = hits[0][0]
    path.write_text(rx.sub(m.replacement, path.read_text(), count=1))
    return None


def run_guards(
    tree: Path, guards: tuple[str, ...], extra: list[str], timeout_s: float
) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["PYTHONPATH"] = str(tree)
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *extra, *guards]
    try:
        done = subprocess.run(
            argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    return done.returncode, (done.stdout + done.stderr)[-1500:]


def verdict(m: Mutation, rc: int) -> str:
    if rc == 1:
        return "caught"
    if rc == 0:
        return "MISSED"
    return f"error (pytest rc {rc})"


def each_guard(tree: Path, m: Mutation, timeout_s: float) -> tuple[str, str]:
    """Run every guard on its own: which of them notice (not only the first to fail)."""
    missed: list[str] = []
    tail = ""
    for guard in m.guards:
        rc, out = run_guards(tree, (guard,), [], timeout_s)
        if rc != 1:
            missed.append(f"{guard.rsplit('::', 1)[-1]} ({verdict(m, rc)})")
            tail = out
    caught = len(m.guards) - len(missed)
    if not missed:
        return f"caught by each of {caught} guards", tail
    return f"caught by {caught} of {len(m.guards)}; not by {', '.join(missed)}", tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", action="append", default=[], help="mutation names (substring)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--baseline", action="store_true", help="also run each guard unmutated")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    ap.add_argument("--each", action="store_true", help="run every guard on its own")
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's tail per row")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(o in m.name for o in args.only)]
    if args.list:
        for m in chosen:
            print(f"{m.name:24s} {m.what}\n{'':24s} guards: {', '.join(m.guards)}")
        return 0
    rows: list[tuple[str, str, str, str, float]] = []
    for m in chosen:
        t0 = time.monotonic()
        base = "-"
        with tempfile.TemporaryDirectory(prefix=f"kvroute-mut-{m.name}-") as tmp:
            tree = Path(tmp)
            copy_tree(ROOT, tree)
            if args.baseline and m.pattern is not None:
                rc, _ = run_guards(tree, m.guards, [], args.timeout)
                base = "pass" if rc == 0 else f"FAIL (rc {rc})"
            if m.pattern is None:
                # A property today's code lacks: its xfail guard must fail when run as a test.
                rc, tail = run_guards(tree, m.guards, ["--runxfail"], args.timeout)
                result = "caught (today's code, xfail)" if rc == 1 else verdict(m, rc)
            else:
                why = apply(m, tree)
                if why is not None:
                    rows.append((m.name, m.what, why, base, time.monotonic() - t0))
                    print(f"{m.name}: {why}", flush=True)
                    continue
                if args.each and len(m.guards) > 1:
                    result, tail = each_guard(tree, m, args.timeout)
                else:
                    rc, tail = run_guards(tree, m.guards, [], args.timeout)
                    result = verdict(m, rc)
        took = time.monotonic() - t0
        rows.append((m.name, m.what, result, base, took))
        print(f"{m.name}: {result} ({took:.0f}s)", flush=True)
        if args.verbose or result.startswith(("MISSED", "error")):
            print(tail)
    print()
    print("| mutation | what breaks | result | unmutated | s |")
    print("|---|---|---|---|---|")
    for name, what, result, base, took in rows:
        print(f"| {name} | {what} | {result} | {base} | {took:.0f} |")
    missed = [r for r in rows if not r[2].startswith("caught") or " not by " in r[2]]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
