"""``fedpipe register-node``: register a device's public key at a SuperLink (node auth)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from fedpipe.cli.preflight import check_file
from fedpipe.launch.engines import flower_env, write_connection

__all__ = ["cmd_register_node"]


def cmd_register_node(args: argparse.Namespace) -> int:
    """``flwr supernode register`` against a SuperLink, with a private FLWR_HOME."""
    key = check_file(args.public_key, "public_key", "public key")
    ca_arg = args.tls_ca or args.root_certificates
    ca = check_file(ca_arg, "--tls-ca", "CA certificate") if ca_arg else None
    with tempfile.TemporaryDirectory(prefix="fedpipe-flwr-") as home:
        write_connection(home, superlink=args.superlink, insecure=ca is None, root_certificates=ca)
        flwr = Path(sys.executable).parent / "flwr"
        done = subprocess.run(  # noqa: S603 - fixed argv
            [str(flwr) if flwr.exists() else "flwr", "supernode", "register", str(key), "fedpipe"],
            env=flower_env(home),
            capture_output=True,
            text=True,
            timeout=120,
        )
    print((done.stdout + done.stderr).strip(), file=sys.stderr)
    return done.returncode
