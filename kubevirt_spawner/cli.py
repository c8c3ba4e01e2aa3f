"""The `kubevirt-spawner` command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys


def _sim(args) -> int:
    try:
        from .sim.app import serve_forever
        from .sim.schema import SchemaError
    except ModuleNotFoundError as exc:  # the hub's own install has no simulator dependencies
        print(f"kubevirt-spawner sim: the simulator needs {exc.name}, which is not installed: "
              "pip install 'kubevirt-spawner[demo]'", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve_forever(args.state, args.port, speed=args.speed, schemas_dir=args.schemas,
                                  guest_mode=args.guests, guest_command=args.guest_command or None,
                                  golden_image=args.golden_image, node_pools=args.node_pools))
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


def _client(work) -> int:
    """Run one of the SSH client's commands: its failures are one sentence and exit status 2."""
    from .ssh import EXIT_REFUSED, ClientError
    try:
        return work()
    except ClientError as err:
        print(f"kubevirt-spawner: {err}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 130


def _login(args) -> int:
    import getpass

    from . import ssh

    def work() -> int:
        url = ssh.hub_url(args.hub_url or os.environ.get("JUPYTERHUB_URL") or "")
        token = args.token or os.environ.get("JUPYTERHUB_API_TOKEN")
        if not token:
            token = (getpass.getpass(f"API token (from {url}hub/token): ") if sys.stdin.isatty()
                     else sys.stdin.readline()).strip()
        if not token:
            raise ssh.ClientError(f"No token given: make one on {url}hub/token.")
        login = ssh.Login(url, token)
        name = asyncio.run(ssh.check_login(login))
        path = ssh.config_path()
        ssh.write_config(path, login)
        print(f"Logged in to {url} as {ssh.names.printable(name)}; saved in {path} (mode 0600).", file=sys.stderr)
        return 0
    return _client(work)


def _tunnel(args) -> int:
    from . import ssh
    return _client(lambda: asyncio.run(ssh.tunnel(ssh.resolve_login(args.hub_url, args.token), args.workstation,
                                                  not args.no_start, sys.stderr)))


def _ssh(args) -> int:
    from . import ssh

    def work() -> int:
        login = ssh.resolve_login(args.hub_url, args.token)
        me = asyncio.run(ssh.check_login(login))
        user, server = ssh.target(args.workstation, me)
        spec = f"{user}/{server}" if server else user
        exe = shutil.which("ssh")
        if not exe:
            raise ssh.ClientError("OpenSSH's ssh is not on the PATH; install openssh-client.")
        alias = ssh.host_alias(user, server)
        options, remote = ssh.split_ssh_args(list(args.remote))
        command = [exe, "-o", f"ProxyCommand={ssh.proxy_command(login.url, spec, not args.no_start)}",
                   "-o", f"HostKeyAlias={alias}.{ssh.urlsplit(login.url).hostname}",
                   "-l", ssh.linux_user(user), *args.ssh_args, *options, alias, *remote]
        # the tunnel (ssh's ProxyCommand) reads the token from the environment, never from its command line
        env = {**os.environ, "JUPYTERHUB_API_TOKEN": login.token, "JUPYTERHUB_URL": login.url}
        os.execve(exe, command, env)
    return _client(work)


def _ssh_config(args) -> int:
    from . import ssh

    def work() -> int:
        login = ssh.resolve_login(args.hub_url, args.token)
        servers = asyncio.run(ssh.workstations(login))
        block = ssh.config_block(login.url, servers, args.prefix)
        if not args.write:
            sys.stdout.write(block)
            return 0
        path = os.path.expanduser(args.write)
        ssh.write_ssh_config(path, login.url, block)
        hosts = ", ".join(ssh.host_alias(u, s, args.prefix) for u, s in servers)
        print(f"Wrote {hosts} to {path}.", file=sys.stderr)
        if not ssh.read_config(ssh.config_path()).get("token"):
            print("The Host blocks hold no token: run kubevirt-spawner login once, so that ssh and your editor "
                  "find it.", file=sys.stderr)
        return 0
    return _client(work)


def _admin_drain(args) -> int:
    from . import admin, ssh
    return _client(lambda: asyncio.run(admin.drain(ssh.resolve_login(args.hub_url, args.token), args.node,
                                                   args.dry_run, args.reason, args.timeout, sys.stdout)))


def _acceptance(args) -> int:
    from . import acceptance
    return acceptance.main(args)


def _add_login_flags(parser) -> None:
    parser.add_argument("--hub-url", default=None, help="the hub's URL (default: $JUPYTERHUB_URL, else the login's)")
    parser.add_argument("--token", default=None, help="a JupyterHub API token (default: $JUPYTERHUB_API_TOKEN, "
                                                      "else the login's); prefer the environment or the login")


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
    sim.add_argument("--node-pools", action="store_true",
                     help="start the CPU nodes in the workstation pool, labelled and tainted as "
                          "deploy/host/label-nodes.sh leaves them (as the demo does)")
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
    login = sub.add_parser("login", help="save the hub's URL and an API token for the SSH commands (mode 0600)")
    _add_login_flags(login)
    login.set_defaults(func=_login)
    tunnel = sub.add_parser("tunnel", help="connect stdin/stdout to a workstation's sshd (OpenSSH's ProxyCommand)")
    tunnel.add_argument("workstation", nargs="?", default=None, help="USER or USER/SERVER (default: your own)")
    tunnel.add_argument("--no-start", action="store_true", help="refuse a stopped workstation instead of starting it")
    _add_login_flags(tunnel)
    tunnel.set_defaults(func=_tunnel)
    ssh = sub.add_parser("ssh", help="open an SSH session in a workstation through the hub (starts it if stopped)")
    ssh.add_argument("workstation", nargs="?", default=None, help="USER or USER/SERVER (default: your own)")
    ssh.add_argument("remote", nargs="*", default=[], metavar="ssh args",
                     help="after --: OpenSSH's own options, then what to run there (default: a shell)")
    ssh.add_argument("--no-start", action="store_true", help="refuse a stopped workstation instead of starting it")
    ssh.add_argument("-o", dest="ssh_args", action="append", default=[], type=lambda v: f"-o{v}",
                     help="an OpenSSH option for ssh, e.g. -o ServerAliveInterval=30")
    _add_login_flags(ssh)
    ssh.set_defaults(func=_ssh)
    config = sub.add_parser("ssh-config", help="print (or --write) ~/.ssh/config Host blocks for your workstations")
    config.add_argument("--write", nargs="?", const="~/.ssh/config", default=None, metavar="FILE",
                        help="replace this hub's block in FILE (default ~/.ssh/config) instead of printing it")
    config.add_argument("--prefix", default="kubevirt.", help="the Host names' prefix (default kubevirt.)")
    _add_login_flags(config)
    config.set_defaults(func=_ssh_config)
    admin = sub.add_parser("admin", help="what a hub admin does: drain a node's workstations")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    drain = admin_sub.add_parser("drain", help="warn the workstations on a node, stop each after its grace, wait "
                                               "until none runs there, then print the kubectl drain to run")
    drain.add_argument("node", help="the node's Kubernetes name")
    drain.add_argument("--dry-run", action="store_true", help="only list who would be warned")
    drain.add_argument("--reason", default=None, help="why, shown to the users in their warning (one line)")
    drain.add_argument("--timeout", type=float, default=None,
                       help="seconds to wait for the workstations to stop (default: the grace and 5 minutes)")
    _add_login_flags(drain)
    drain.set_defaults(func=_admin_drain)
    acc = sub.add_parser("acceptance", help="run the design document's acceptance experiments against a hub "
                                            "(an admin's token), with a report")
    _add_login_flags(acc)
    acc.add_argument("--kubeconfig", default=None, help="read access to the cluster (deploy/acceptance/acceptance-reader.yaml):"
                                                        " nodes, pods, the test VMs, claims, volume attachments")
    acc.add_argument("--user", default=None,
                     help="the test user (made if missing; default: kvs-acceptance-TAG, new each run and deleted "
                          "after); the run's workstation and helper users are new even for a user of the hub's")
    acc.add_argument("--profile", default=None, help="the profile of the test workstation (default: the hub's default)")
    acc.add_argument("--only", default=None, help="sections to run, comma-separated: host, persistence, storage, security")
    acc.add_argument("--clones", type=int, default=2, help="workstations cloned at once (default 2; 0: none)")
    acc.add_argument("--grow-profile", default=None, help="a profile with a larger root disk, to see a disk grow")
    acc.add_argument("--idle-wait", type=float, default=900.0,
                     help="the longest idle timeout (seconds) the suite waits out to see the warning and the stop")
    acc.add_argument("--start-timeout", type=float, default=1800.0, help="seconds a start may take (default 1800)")
    acc.add_argument("--destructive", action="store_true", help="with --node: ask the admin to power the node off "
                                                                "and fence it, then check the cold start elsewhere")
    acc.add_argument("--node", default=None, help="the node --destructive loses (the test workstation must run there)")
    acc.add_argument("--pool-label", default="workload.example.com/kubevirt",
                     help="the workstation pools' node label (deploy/settings.env KUBEVIRT_NODE_LABEL)")
    acc.add_argument("--accelerator-label", default="accelerator.example.com/mode",
                     help="the node label whose value vfio marks GPU passthrough nodes (ACCELERATOR_LABEL)")
    acc.add_argument("--report", action="append", default=[], metavar="FILE",
                     help="write the report to FILE.json, FILE.html or FILE.md (repeatable)")
    acc.set_defaults(func=_acceptance)
    argv = list(sys.argv[1:] if argv is None else argv)
    # `ssh [USER[/SERVER]] [options] -- ssh args`: what follows -- is OpenSSH's (its options, then
    # a command), whatever came before it (argparse would have filled that place already).
    remote: list[str] = []
    if "--" in argv and "ssh" in argv[:argv.index("--")]:
        cut = argv.index("--")
        argv, remote = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if remote:
        args.remote = list(getattr(args, "remote", [])) + remote
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("sim", "demo") and args.speed <= 0:
        parser.error("--speed must be positive")
    if args.command == "sim" and args.golden_image and args.guests != "qemu":
        parser.error("--golden-image is for --guests qemu (the other guests boot no disk image)")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
