"""E2B compatibility: the unmodified `e2b` SDK works against a sandlot server.

Point the SDK at it with::

    E2B_API_URL=http://<host>:<port>/e2b            # control plane (api.py)
    E2B_SANDBOX_URL=http://<host>:<port>/e2b/envd   # in-sandbox envd, every sandbox (envd.py)
    E2B_API_KEY=<a sandlot API key>

Modules: `api` (REST routes), `envd` (in-sandbox routing and auth), `process` and
`filesystem` (the Connect services), `files` (/files, /health), `connect` (framing),
`convert` (shapes, users, paths), `templates` (template builds), `lifecycle`
(pause/resume as snapshots), `volumes` (volume records), `volume_content`
(a volume's files), `errors` (every error shape,
in one place). See docs/e2b.md.
"""

from fastapi import APIRouter

from sandlot.server.e2b.api import router as api_router
from sandlot.server.e2b.envd import router as envd_router
from sandlot.server.e2b.envd import signed_router
from sandlot.server.e2b.templates import router as templates_router
from sandlot.server.e2b.templates import upload_router
from sandlot.server.e2b.volume_content import router as volume_content_router
from sandlot.server.e2b.volumes import router as volumes_router

router = APIRouter()
router.include_router(envd_router)  # first: the API's catch-all would shadow /e2b/envd
router.include_router(templates_router)  # before the API's catch-all
router.include_router(upload_router)
router.include_router(volumes_router)  # before the API's catch-all
router.include_router(volume_content_router)  # before the API's catch-all
router.include_router(api_router)
router.include_router(signed_router)  # /files at the root: download_url(), upload_url()

__all__ = ["router"]
