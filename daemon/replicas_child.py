"""One data-parallel replica: the usual supervisor (cpud.supervisor) with the frontend, the ranks
and the port the host's plan gave this replica.

Started by cpud.replicas as `replicas_child SPEC PARENT_PID`, the API key on stdin (never in the
spec file, the command line or the environment). Its sd_notify messages (READY=1, STATUS,
WATCHDOG=1) go to the socket its parent names in NOTIFY_SOCKET; its exit code tells the parent
what to do: 0 drained, 2 a configuration refused (stop everything), 3 a child lost (restart).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import msgspec

from cpud.process.parent_death import die_with_parent
from cpud.protocol.launch import FrontendSecrets
from cpud.replicas_spec import read_spec
from cpud.settings.config import EngineArgs

EXIT_CONFIG = 2


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    die_with_parent(int(args[1]))
    secrets = msgspec.json.decode(sys.stdin.buffer.read(), type=FrontendSecrets)
    from cpud.process.log_setup import REPLICA_ENV, configure_logging
    from cpud.process.sd_notify import Notifier
    from cpud.settings.errors import CpudError
    from cpud.supervisor import Supervisor

    try:
        spec = read_spec(args[0])
        # Before logging starts: this supervisor, its frontend and its ranks log the replica.
        os.environ[REPLICA_ENV] = str(spec.placement.index)
        configure_logging()
        engine_args = EngineArgs(**spec.engine_args)
        serve_args = dataclasses.replace(spec.serve_args, api_key=secrets.api_key)
        return Supervisor(engine_args, serve_args, Notifier(), spec.placement).run()
    except CpudError as exc:
        print(f"cpud: replica error: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
