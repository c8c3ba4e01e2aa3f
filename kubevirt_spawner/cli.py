"""The `kubevirt-spawner` command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys


def _sim(args) -> int:
    from .sim.app import serve_forever
    from .sim.schema import SchemaError
    try:
        asyncio.run(serve_forever(args.state, args.port, speed=args.speed, schemas_dir=args.schemas,
                                  guest_mode=args.guests, guest_command=args.guest_command or None,
                                  golden_image=args.golden_image))
    except (SchemaError, ValueError) as exc:
        print(f"kubevirt-spawner sim: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kubevirt-spawner sim: cannot serve on port {args.port}: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo(args) -> int:
    from .demo import run
    return run(args.state, args.port, args.speed)


def _service(args) -> int:
    from .service.web import serve
    # JupyterHub stops its managed services with SIGINT (then SIGTERM after interrupt_timeout), and a
    # hub started from a background job hands it down ignored, which Python then leaves ignored:
    # answer it in any case.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C (a hand-started service) is a normal end
        asyncio.run(serve(args.port, args.config, args.ip))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubevirt-spawner", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("sim", help="run the local KubeVirt cluster simulator")
    sim.add_argument("--state", required=True, help="directory for the cluster's objects, volumes and kubeconfig")
    sim.add_argument("--port", type=int, default=0, help="API server port on 127.0.0.1 (default: any free port)")
    sim.add_argument("--speed", type=float, default=1.0, help="controller speed factor (10 = ten times faster)")
    sim.add_argument("--schemas", default=None, help="folder of the upstream schemas (default: ../shared/schemas "
                                                     "or $KUBEVIRT_SCHEMAS_DIR)")
    sim.add_argument("--guests", choices=("process", "null", "qemu"), default="process",
                     help="run a Jupyter server per running VMI, one shared null responder, or a QEMU virtual "
                          "machine booting the VM's disk")
    sim.add_argument("--golden-image", default=None,
                     help="with --guests qemu: the directory deploy/golden-image/build.sh made (its disk fills "
                          "the golden PVC, its kernel boots the machines)")
    sim.add_argument("--guest-command", nargs="*", help="command each guest runs instead of Jupyter")
    sim.set_defaults(func=_sim)
    demo = sub.add_parser("demo", help="run the local demo: simulator, proxy and JupyterHub")
    demo.add_argument("--state", required=True, help="directory for the demo's cluster, hub database and logs")
    demo.add_argument("--port", type=int, default=8000, help="public port of the hub on 127.0.0.1 (default 8000)")
    demo.add_argument("--speed", type=float, default=5.0, help="simulated cluster speed factor (default 5)")
    demo.set_defaults(func=_demo)
    service = sub.add_parser("service", help="run the workstations hub service (JupyterHub starts it)")
    service.add_argument("--ip", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    service.add_argument("--port", type=int, default=10101, help="port to listen on (default 10101)")
    service.add_argument("--config", default=None, help="the hub's config file (default: "
                                                        "$KUBEVIRT_SPAWNER_HUB_CONFIG, set by service.register)")
    service.set_defaults(func=_service)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("sim", "demo") and args.speed <= 0:
        parser.error("--speed must be positive")
    if args.command == "sim" and args.golden_image and args.guests != "qemu":
        parser.error("--golden-image is for --guests qemu (the other guests boot no disk image)")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
