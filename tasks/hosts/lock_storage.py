"""Where the host lock's leases live: on disk, so they outlive a restarted Prefect server.

Prefect's server reads this setting once, at its start, so it must be in the environment
before the server process is launched (flows/api_server.py launches it before Prefect is even
imported). An explicit setting wins. tasks/hosts/lock.py says why leases are on disk.
"""

from __future__ import annotations

import os

LEASE_STORAGE_ENV = "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"
FILE_LEASES = "prefect.server.concurrency.lease_storage.filesystem"


def use_file_leases() -> None:
    os.environ.setdefault(LEASE_STORAGE_ENV, FILE_LEASES)


use_file_leases()  # on import, which flows do before their first API call
