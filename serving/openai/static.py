"""The chat page: static HTML, CSS and JavaScript (no build step) served by the API's own app.

The page talks to the same server's OpenAI API (`GET /v1/models`, streaming
`POST /v1/chat/completions`), so it needs nothing from the app but these two routes.
"""

from __future__ import annotations

from pathlib import Path

import fastapi
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")


def mount_chat_page(app: fastapi.FastAPI) -> None:
    """Serves the chat page at `GET /` and its assets under `/static/`."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
