"""The guest server extension: runs inside every workstation (under jupyterhub-singleuser) and
lets the JupyterLab "Workstation" panel call the hub-side workstations service with this
server's own hub token.

Enable it with ``c.ServerApp.jpserver_extensions = {"kubevirt_spawner.guest": True}``.
It imports nothing else of kubevirt_spawner: the guest never carries the hub's code.
"""



def _jupyter_server_extension_points():
    return [{"module": "kubevirt_spawner.guest"}]


def _load_jupyter_server_extension(serverapp):
    # Imported here, not with the package: the workstation unit's `kubevirt-workstation`
    # (guest.launch) only execs Jupyter, and Jupyter's modules cost it seconds of a boot.
    from . import activity
    from .proxy import ActivityReporter, setup_handlers
    guest = setup_handlers(serverapp)
    try:
        from . import sshd  # (jupyter-server-proxy: the [guest] extra brings it)
    except ImportError as err:
        serverapp.log.warning("SSH tunnel: not served: %s (install kubevirt-spawner[guest])", err)
    else:
        sshd.setup_handlers(serverapp, guest)
        from . import vscode  # (jupyter-server-proxy too)
        vscode.setup_handlers(serverapp, guest)
    # what keeps the machine busy beyond Jupyter (logins, GPUs): the hub's activity, and the why
    activity.start(serverapp, ActivityReporter(guest))
