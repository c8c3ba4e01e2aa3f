"""Loaded into the hub that bench/scale.py runs (from its extra config): where the hub's CPU goes,
and which slow event-loop callbacks are the spawner's.

- Every thread's CPU time, from /proc (Linux): the watch caches' threads (`reflector-*`) and the
  Kubernetes client's pool (`kube_*`) are the spawner's entirely.
- The event loop thread is sampled every few milliseconds: a sample is idle (waiting in the
  selector), busy in the spawner's code (any `kubevirt_spawner` frame on the stack) or busy in
  anything else (JupyterHub, tornado, SQLAlchemy...). Its CPU time is split by those shares.
- The loop runs in asyncio debug mode: every callback longer than the threshold is logged by
  asyncio; each is matched with the samples taken while it ran, to tell whether it was ours.
  Debug mode's recording of where each handle and future was made is switched off (it would
  cost more than everything measured); what remains of it is counted apart.
Everything goes to a JSON-lines file, one line per second and one per slow callback.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import logging
import os
import re
import sys
import threading
import time
import traceback

OURS = os.sep + "kubevirt_spawner" + os.sep
# The spawner talks to the API server over TLS on the hub's loop; the hub's own connections here
# (proxy, users, the hub API) are plain HTTP. So what asyncio's TLS layer runs (receiving and
# decrypting answers and watch events, then aiohttp parsing them) is the spawner's as well.
OURS_TRANSPORT = os.sep + "asyncio" + os.sep + "sslproto.py"
SELECTOR_TRANSPORT = os.sep + "asyncio" + os.sep + "selector_events.py"
IDLE_FILES = (os.sep + "selectors.py",)
# asyncio's debug mode records where every handle and future was made (format_helpers, traceback,
# linecache): the benchmark's own cost, not the spawner's nor the hub's.
DEBUG_FILES = (os.sep + "format_helpers.py", os.sep + "linecache.py", os.sep + "traceback.py")
TICK = os.sysconf("SC_CLK_TCK")
SLOW = re.compile(r"^Executing (?P<what>.*) took (?P<seconds>[0-9.]+) seconds$", re.S)


def thread_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process, by native thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return out


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Probe:
    def __init__(self, out_path: str, interval: float = 0.004, slow_seconds: float = 0.02):
        self.out_path = out_path
        self.interval = interval
        self.slow_seconds = slow_seconds
        # (time, state, our function, the loop thread's CPU seconds so far)
        self.samples: collections.deque = collections.deque(maxlen=50000)
        self.counts = collections.Counter()
        self.functions = collections.Counter()  # where the loop was in the spawner's code
        self.lock = threading.Lock()
        self.main_ident = 0
        self.out = open(out_path, "a", buffering=1)
        self.full_collections: list[tuple[float, float]] = []  # (when it ended, seconds)

    def install(self):
        loop = asyncio.get_running_loop()
        loop.set_debug(True)
        loop.slow_callback_duration = self.slow_seconds
        # Keep debug mode's slow-callback check, not its bookkeeping: recording where every handle,
        # future and coroutine was made costs more CPU than the whole spawner, in whichever thread
        # makes them (a watch thread waking the loop included), and a production hub does not pay it.
        asyncio.format_helpers.extract_stack = lambda f=None, limit=None: traceback.StackSummary()
        sys.set_coroutine_origin_tracking_depth(0)
        self.main_ident = threading.get_ident()
        self.main_clock = time.pthread_getcpuclockid(self.main_ident)
        handler = logging.Handler(logging.WARNING)
        handler.emit = self._slow_callback  # type: ignore[method-assign]
        logging.getLogger("asyncio").addHandler(handler)
        self._count_watch_events()
        gc.callbacks.append(self._gc_callback)
        threading.Thread(target=self._run, name="scale-probe", daemon=True).start()

    def _count_watch_events(self):
        """Count the watch events the caches apply, by resource (on the loop, where they land)."""
        from kubevirt_spawner import reflector

        events = self.watch_events = collections.Counter()
        apply = reflector.Reflector._apply

        def counting_apply(cache, changes):
            events[cache.kind.plural] += len(changes)
            return apply(cache, changes)
        reflector.Reflector._apply = counting_apply  # type: ignore[method-assign]

    def _classify(self, frame) -> tuple[str, str]:
        if frame is None:
            return "idle", ""
        if frame.f_code.co_filename.endswith(IDLE_FILES):
            return "idle", ""
        innermost = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
        inner, depth = frame, 0
        while inner is not None and depth < 12:
            if inner.f_code.co_filename.endswith(DEBUG_FILES):
                return "debug", ""
            inner, depth = inner.f_back, depth + 1
        ours = ""
        while frame is not None:
            if OURS in frame.f_code.co_filename or frame.f_code.co_filename.endswith(OURS_TRANSPORT) \
                    or self._tls_transport(frame):
                ours = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
                break
            frame = frame.f_back
        return ("ours", f"{ours} > {innermost}") if ours else ("other", "")

    @staticmethod
    def _tls_transport(frame) -> bool:
        """A socket transport reading or writing for a TLS protocol: one of the spawner's
        connections (asyncio's selector code runs before the TLS layer's own frames appear)."""
        if not frame.f_code.co_filename.endswith(SELECTOR_TRANSPORT):
            return False
        transport = frame.f_locals.get("self")
        return isinstance(getattr(transport, "_protocol", None), asyncio.sslproto.SSLProtocol)

    def _run(self):
        next_report = time.monotonic() + 1.0
        while True:
            time.sleep(self.interval)
            state, where = self._classify(sys._current_frames().get(self.main_ident))
            now = time.time()
            cpu = time.clock_gettime(self.main_clock)
            with self.lock:
                self.samples.append((now, state, where, cpu))
                self.counts[state] += 1
                if where:
                    self.functions[where] += 1
            if time.monotonic() >= next_report:
                next_report += 1.0
                self._report(now)

    def _report(self, now: float):
        names = {t.native_id: t.name for t in threading.enumerate()}
        main_native = next((t.native_id for t in threading.enumerate() if t.ident == self.main_ident), None)
        threads: dict[str, float] = collections.defaultdict(float)
        for tid, seconds in thread_cpu().items():
            name = "main" if tid == main_native else names.get(tid, "other-native")
            kind = ("main" if name == "main" else "probe" if name == "scale-probe"
                    else "watches" if name.startswith("reflector-") else "client" if name.startswith("kube")
                    else "other")
            threads[kind] += seconds
        with self.lock:
            counts = dict(self.counts)
            functions = dict(self.functions)
            collections_done = list(self.full_collections)
        self.out.write(json.dumps({"t": now, "cpu": threads, "main_samples": counts, "rss": rss_bytes(),
                                   "functions": functions, "watch_events": dict(self.watch_events),
                                   "full_collections": [len(collections_done),
                                                        sum(length for _, length in collections_done),
                                                        max((length for _, length in collections_done), default=0)]})
                       + "\n")

    def _gc_callback(self, phase: str, info: dict):
        """Collections of the oldest generation, when and how long: a pause of the whole hub (its
        length follows everything the hub holds), wherever the allocation that set it off was."""
        if info.get("generation") != 2:
            return
        now = time.perf_counter()
        if phase == "start":
            self._gc_started = now
        elif getattr(self, "_gc_started", None) is not None:
            with self.lock:
                self.full_collections.append((time.time(), now - self._gc_started))
            self._gc_started = None

    def _slow_callback(self, record: logging.LogRecord):
        m = SLOW.match(record.getMessage())
        if not m:
            return
        seconds = float(m.group("seconds"))
        end = record.created
        with self.lock:
            window = [(state, where, cpu) for t, state, where, cpu in self.samples
                      if end - seconds - 0.005 <= t <= end]
        busy = [w for w in window if w[0] != "idle"]
        ours = collections.Counter(where for state, where, _ in busy if state == "ours")
        # CPU the loop thread really used meanwhile: a callback that waited for a CPU or the GIL
        # is slow but not costly.
        cpu = (window[-1][2] - window[0][2]) if len(window) > 1 else 0.0
        with self.lock:
            gc_seconds = sum(length for t, length in self.full_collections if end - seconds - 0.005 <= t <= end + 0.005)
        self.out.write(json.dumps({"t": end, "slow": m.group("what")[:300], "seconds": seconds, "cpu": cpu,
                                   "samples": len(busy), "ours": sum(ours.values()), "gc": gc_seconds,
                                   "our_functions": ours.most_common(3)}) + "\n")
