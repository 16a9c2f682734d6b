"""``fedpipe client``: one device, a Flower SuperNode that runs fedpipe's ClientApp."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from fedpipe.cli.preflight import ClientSetup, check_client
from fedpipe.config.flower_keys import NodeSettings
from fedpipe.launch.engines import start_supernode

__all__ = ["client_setup", "cmd_client", "node_config"]


def client_setup(args: argparse.Namespace) -> ClientSetup:
    return ClientSetup(
        superlink=args.superlink,
        stage_server=args.stage_server,
        partition_id=args.partition_id,
        num_partitions=args.num_partitions,
        profile=args.profile,
        data=args.data,
        supernode_port=args.supernode_port,
        superlink_ca=args.tls_ca or args.root_certificates,
        stage_ca=args.tls_ca or args.stage_ca,
        auth_key=args.auth_key,
        stage_cert=args.tls_cert,
        stage_key=args.tls_key,
        cut=args.cut,
        privacy=args.privacy,
        weights=args.weights,
    )


def node_config(setup: ClientSetup) -> dict[str, Any]:
    """What the ClientApp reads from its SuperNode (:class:`NodeSettings`): partition, profile,
    data, StageServer; files as absolute paths."""
    return NodeSettings(
        partition_id=setup.partition_id,
        num_partitions=setup.num_partitions,
        profile=setup.profile,
        data=_absolute(setup.data),
        cut=setup.cut or "",
        privacy=setup.privacy or "",
        weights=setup.weights or "",
        stage_address=setup.stage_server or "",
        stage_ca=_absolute(setup.stage_ca),
        stage_cert=_absolute(setup.stage_cert),  # mutual TLS: this device's own pair
        stage_key=_absolute(setup.stage_key or "") if setup.stage_cert else "",
    ).to_node_config()


def _absolute(path: str | Path | None) -> str:
    return str(Path(path).expanduser().resolve()) if path else ""


def own_settings(setup: ClientSetup) -> str:
    """This device's own settings for its start-up line (a profile other than loopback, its cut
    and its privacy spec), so the user sees what the device will run with; "" when none."""
    own = [
        ("profile", setup.profile if setup.profile != "loopback" else None),
        ("cut", setup.cut),
        ("privacy", setup.privacy),
        ("weights", setup.weights),
    ]
    return ", ".join(f"{key} {value}" for key, value in own if value)


def cmd_client(args: argparse.Namespace) -> int:
    setup = client_setup(args)
    check_client(setup)
    # Handlers first: a SIGTERM during start-up still stops the SuperNode (start_supernode
    # stops it itself if it raises), and SIGTERM, SIGHUP or Ctrl-C later stop it and its
    # ClientApps. A SIGKILL is covered by the SuperNode's watchdog (processes.py).
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    node = start_supernode(
        superlink=setup.superlink,
        port=setup.supernode_port,
        node_config=node_config(setup),
        insecure=setup.superlink_ca is None,
        root_certificates=setup.superlink_ca,
        auth_key=setup.auth_key,
        workdir=args.workdir,
    )
    own = own_settings(setup)
    print(
        f"fedpipe: SuperNode pid {node.pid} (port {node.address.rsplit(':', 1)[1]}) connected to "
        f"{setup.superlink} as partition {setup.partition_id}/{setup.num_partitions}"
        f"{f'; {own}' if own else ''} (log {node.log_path})",
        file=sys.stderr,
        flush=True,
    )
    rc = 0
    try:
        while not stop.wait(1.0):
            if not node.alive():
                print(
                    f"fedpipe: SuperNode exited (rc {node.popen.returncode}); log {node.log_path}",
                    file=sys.stderr,
                )
                rc = 1
                break
    finally:
        node.stop()
    return rc
