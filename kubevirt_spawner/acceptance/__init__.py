"""`kubevirt-spawner acceptance`: the design document's production acceptance experiments (section
13), run against a hub, on the simulator in CI and unchanged on a real cluster. Public interfaces
only: JupyterHub's REST API, the workstation's Jupyter through the hub, the workstations service,
and, with a kubeconfig, read access to the cluster (deploy/acceptance/acceptance-reader.yaml)."""

from __future__ import annotations

import asyncio
import sys
import time
from datetime import datetime, timezone
from typing import Any, TextIO

import aiohttp

from .client import AcceptanceError, Target
from .experiments import Options, Suite
from .report import FAIL, REPORT_FORMATS, SECTIONS, Record, render

EXIT_FAILED = 1  # an experiment failed
EXIT_REFUSED = 2  # the suite could not run (bad input, a hub that refuses)


def parse_only(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise ValueError(f"--only {text}: unknown section {unknown[0]}; choose from {', '.join(SECTIONS)}.")
    return chosen


def check_reports(paths: list[str]) -> None:
    for path in paths:
        if not path.lower().endswith(REPORT_FORMATS):
            raise ValueError(f"--report {path}: name a .json, .html or .md file.")
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as err:
            raise ValueError(f"--report {path}: cannot write it ({err.strerror}).") from None


async def run_suite(url: str, token: str, kubeconfig: str | None, options: Options, out: TextIO = sys.stdout,
                    prompt=None, suite_class: type[Suite] = Suite) -> tuple[list[Record], dict]:
    from .. import __version__
    cluster = None
    if kubeconfig:
        from .cluster import Cluster
        cluster = Cluster(kubeconfig)
    began = time.monotonic()
    meta: dict[str, Any] = {"hub_url": url, "user": options.user, "profile": options.profile,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "version": __version__,
            "kubeconfig": bool(kubeconfig), "only": list(options.only), "destructive": options.destructive}
    async with aiohttp.ClientSession() as session:
        suite = suite_class(Target(session, url, token), cluster, options, out, prompt)
        meta["user"] = suite.user
        try:
            await suite.run()
        finally:
            meta["duration"] = round(time.monotonic() - began, 1)
    return suite.records, meta


def write_reports(paths: list[str], records: list[Record], meta: dict) -> None:
    for path in paths:
        with open(path, "w", encoding="utf-8") as f:
            f.write(render(path, records, meta))


def main(args, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The command: prints each experiment as it ends, writes the reports, exits 1 on any FAIL."""
    out, err = out or sys.stdout, err or sys.stderr
    from ..ssh import ClientError, hub_url, resolve_login
    try:
        options = Options(user=args.user, profile=args.profile, only=parse_only(args.only), clones=args.clones,
                          grow_profile=args.grow_profile, idle_wait=args.idle_wait, destructive=args.destructive,
                          node=args.node, pool_label=args.pool_label, accelerator_label=args.accelerator_label,
                          start_timeout=args.start_timeout)
        if options.destructive and not options.node:
            raise ValueError("--destructive needs --node NODE: the node the suite asks you to power off.")
        if options.clones < 0:
            raise ValueError("--clones is 0 or more.")
        check_reports(args.report)
        login = resolve_login(hub_url(args.hub_url) if args.hub_url else None, args.token)
        records, meta = asyncio.run(run_suite(login.url, login.token, args.kubeconfig, options, out))
    except (ValueError, ClientError, AcceptanceError) as problem:
        print(f"kubevirt-spawner acceptance: {problem}", file=err)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 130
    write_reports(args.report, records, meta)
    failed = sum(1 for r in records if r.result == FAIL)
    print(f"acceptance: {sum(1 for r in records if r.result == 'PASS')} passed, {failed} failed, "
          f"{sum(1 for r in records if r.result == 'SKIP')} skipped in {meta['duration']:.0f} s", file=out)
    return EXIT_FAILED if failed else 0
