"""Image pull by digest: a container lane's image, on each host that runs it, pulled and verified
(tasks/hosts/containers.py), a registry that is down or a missing digest turned into the lane's reason."""

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
    """Pull by digest (skipped when present) and verify on `host_name`; a failure is a reason, not a traceback."""
    transport = live.transport(lane_name, host_name)
    try:
        return ImagePull(ok=True, image=pull_by_digest(transport, docker_host, image_ref))
    except (ImageError, DockerUnavailable) as e:
        return ImagePull(ok=False, reason=str(e))
