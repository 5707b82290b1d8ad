"""Long fuzz run against live ``twopc serve log`` and ``twopc serve cursor`` processes.

The same structure-aware frames as the suite's fuzz test (``tests/support/fuzz_frames.py``: drawn
from the frame schema, some broken on purpose with the CRC recomputed), seeded random draws
instead of Hypothesis so that a million frames take minutes: unauthenticated handshakes at both
servers, and sessions authenticated as ``transfer`` and ``consumer`` (cursor) and ``producer``
(log). At the end the servers must still answer a normal client, be stopped cleanly, start again
on their journals and answer again.

Printed (and written to ``--json``): frames and sessions sent, frames/s, crashes (a server that
died), hangs, ``internal-error`` answers, tracebacks in the servers' output, unrestartable
journals, the histogram of answers, and each server's RSS at start and end.

    python bench/fuzz_servers.py --frames 1000000 [--seed S] [--json PATH] [--burst 20]
        [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.fuzz_frames import RandomDraw
from tests.support.fuzz_servers import Servers, Tally, run_session


def fuzz(servers: Servers, args: argparse.Namespace, seed: int) -> tuple[Tally, float, list[str]]:
    """Sessions until ``args.frames`` frames are sent or a server dies; the tally, the seconds
    taken and the servers that died."""
    draw, tally = RandomDraw(seed), Tally()
    started = last = time.monotonic()
    while tally.frames < args.frames:
        try:
            run_session(servers, draw, tally, draw.integer(1, args.burst))
        except OSError as exc:  # could not even connect or authenticate
            tally.note(f"session failed: {type(exc).__name__}")
            if len(servers.alive()) < 2:
                return (
                    tally,
                    time.monotonic() - started,
                    sorted({"cursor", "log"} - set(servers.alive())),
                )
        if time.monotonic() - last > args.progress:
            last = time.monotonic()
            rate = tally.frames / (last - started)
            print(
                f"{tally.frames} frames, {rate:.0f}/s, failures {tally.failures}, "
                f"RSS KiB {servers.rss_kib()}",
                flush=True,
            )
    return tally, time.monotonic() - started, []


def restart(servers: Servers) -> list[str]:
    """Stop cleanly, start again on the same journals, deliver a message, stop: what failed."""
    servers.stop()
    try:
        servers.start()
    except RuntimeError as exc:  # a journal that does not open: the server exits at start
        servers.stop()
        return [str(exc)[-3000:]]
    delivered = servers.round_trip("fuzz-check-2")
    servers.stop()
    return [] if delivered else ["the restarted servers do not deliver a message"]


def _bytes_under(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--burst", type=int, default=20, help="frames per authenticated session, most")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--keep", action="store_true", help="keep the journals and server output")
    p.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else int(time.time())
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="twopc-fuzz-"))
    servers = Servers(workdir)
    servers.start()
    rss_start = servers.rss_kib()
    print(f"seed {seed}; servers in {workdir}; RSS KiB at start {rss_start}", flush=True)
    tally, elapsed, crashed = fuzz(servers, args, seed)
    rss_end = servers.rss_kib()
    answered = not crashed and servers.round_trip("fuzz-check-1")
    unrestartable = restart(servers)
    tracebacks = servers.tracebacks()
    failures = ("hang", "XA_REPLY internal-error", "ERROR internal-error")
    report = {
        "seed": seed,
        "frames": tally.frames,
        "sessions": tally.sessions,
        "seconds": round(elapsed, 1),
        "frames_per_second": round(tally.frames / elapsed, 1),
        "crashes": crashed,
        "failures": {k: tally.answers[k] for k in failures},
        "failure_examples_hex": tally.examples,
        "tracebacks": len(tracebacks),
        "traceback_heads": tracebacks[:10],
        "unclean_stops": servers.stops,
        "unrestartable_journals": unrestartable,
        "answers_normal_client_after_run": answered,
        "histogram": dict(tally.answers.most_common()),
        "rss_kib_start": rss_start,
        "rss_kib_end": rss_end,
        "rss_kib_growth": {k: rss_end[k] - rss_start[k] for k in rss_start},
        "journal_bytes": {k: _bytes_under(workdir / k) for k in ("cursor", "log")},
    }
    print(json.dumps({k: v for k, v in report.items() if k != "failure_examples_hex"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    bad = crashed or tally.failures or tracebacks or unrestartable or servers.stops or not answered
    if bad:
        print(f"FAILED: the journals and the servers' output are kept in {workdir}")
    elif not args.keep and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
