"""Image pull by digest: a container lane's image, on each host that runs it, pulled and verified.

The pull itself (`docker pull` by digest, skipped when the image is present, then the digest and
platform checked) is the hosts layer's (tasks/hosts/containers.py); this stage runs it through the
transport the lane's served lifecycle holds, and turns a registry that is down or a digest it does
not have into the lane's reason.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from tasks.hosts.containers import DockerUnavailable, ImageError, ImageFacts, pull_by_digest
from tasks.serving import live


class ImagePull(BaseModel):
    """The image-pull stage's outcome: the verified image, or why the lane cannot have it."""

    ok: bool
    reason: str = ""
    image: ImageFacts | None = None


@task(name="image pull", cache_policy=NO_CACHE)
def image_pull(lane_name: str, host_name: str, docker_host: str | None, image_ref: str) -> ImagePull:
    """Pull by digest (skipped when present) and verify, on `host_name` through the transport the
    lane's served lifecycle holds (tasks/serving/live.py); a registry that is down or a digest it
    does not have is a clear reason, not a traceback: the lane fails with it and the rest go on."""
    transport = live.transport(lane_name, host_name)
    try:
        return ImagePull(ok=True, image=pull_by_digest(transport, docker_host, image_ref))
    except (ImageError, DockerUnavailable) as e:
        return ImagePull(ok=False, reason=str(e))
