"""The admin UI: static files from coordinator/ui/, served at /admin/ (no build step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

UI_DIR = Path(__file__).resolve().parent.parent / "ui"


class _Revalidated(StaticFiles):
    """Static files a browser must revalidate (ETag) before reuse: an upgraded coordinator never runs old JS."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


def mount_ui(app: FastAPI, ui_dir: Path = UI_DIR) -> None:
    """GET /admin/ serves the UI's index.html, /admin/static/<file> the rest of its folder."""

    @app.get("/admin", include_in_schema=False)
    async def admin_redirect() -> RedirectResponse:
        return RedirectResponse("/admin/")

    @app.get("/admin/", include_in_schema=False)
    async def admin_index() -> FileResponse:
        return FileResponse(ui_dir / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/admin/static", _Revalidated(directory=ui_dir), name="admin-static")
